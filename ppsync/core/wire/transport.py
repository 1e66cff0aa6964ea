"""Issuing the token path's collective and waiting on it with a deadline.

Gloo reports a silent peer as ``RuntimeError('... timed out ...')`` and a dead
one as a connection error within milliseconds (plain RuntimeErrors, seen on
torch 2.13); torch's typed errors (``DistNetworkError``, ``DistStoreError``,
``DistBackendError``) come from other backends and the store. All become
ppsync's typed errors here, so that an engine never sees a bare
RuntimeError or an endless wait.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ppsync.errors import PeerLost, PPSyncError, SyncTimeout

_LOST_MARKERS = (
    "connection reset",
    "connection closed",
    "broken pipe",
    "connection refused",
    "socket closed",
    "read error",
    "write error",
    "unexpected end",
    "eof",
    "aborted",
)


@dataclass
class TransportClock:
    """CPU time this thread spent issuing the token path's collectives and
    waiting on transfers that had not completed (benchmarks subtract it from a
    call's CPU time to get ppsync's own)."""

    issue_ns: int = 0
    wait_ns: int = 0

    def total(self) -> int:
        return self.issue_ns + self.wait_ns

    def timed_issue(self, issue: Callable[[torch.Tensor], dist.Work],
                    buf: torch.Tensor) -> dist.Work:
        """``issue(buf)``, its CPU time added to :attr:`issue_ns`."""
        t0 = time.thread_time_ns()
        work = issue(buf)
        self.issue_ns += time.thread_time_ns() - t0
        return work


class Broadcaster:
    """Issues the token path's broadcasts on one group, from one root.

    Calls the process group's own ``broadcast`` with options built once:
    ``dist.broadcast``'s Python wrapper (group checks, rank translation)
    costs about as much as the rest of a step (docs/measured.md)."""

    def __init__(self, group: dist.ProcessGroup, root: int) -> None:
        self.group = group
        self.options = dist.BroadcastOptions()
        self.options.rootRank = root  # group rank, not global
        self.options.rootTensor = 0

    def issue(self, buf: torch.Tensor) -> dist.Work:
        """Post one broadcast of ``buf``; never blocks."""
        work: dist.Work = self.group.broadcast([buf], self.options)
        return work


def broadcast_async(buf: torch.Tensor, src: int, group: dist.ProcessGroup) -> dist.Work:
    """Post one broadcast of ``buf`` from global rank ``src`` through the
    public torch.distributed call; never blocks."""
    work: dist.Work | None = dist.broadcast(buf, src=src, group=group, async_op=True)
    assert work is not None  # async_op=True always returns a handle
    return work


def translate(exc: BaseException, *, what: str, timeout_s: float, peer: int | None) -> PPSyncError:
    """Map a torch.distributed failure to SyncTimeout or PeerLost: torch's
    typed errors first (DistNetworkError: a connection failed;
    DistStoreError: the store did not answer in time), then, for what
    carries no type of its own (gloo raises plain RuntimeErrors; NCCL's
    DistBackendError covers timeouts and faults alike), the message."""
    text = str(exc)
    if isinstance(exc, dist.DistNetworkError):
        return _lost(f"{what}: {_who(peer)} is gone ({text})", peer)
    if isinstance(exc, dist.DistStoreError):
        return _timed_out(what, timeout_s, text)
    low = text.lower()
    if "timed out" in low or "timeout" in low:
        return _timed_out(what, timeout_s, text)
    if any(m in low for m in _LOST_MARKERS):
        return _lost(f"{what}: {_who(peer)} is gone ({text})", peer)
    return _lost(f"{what}: transfer failed ({text})", peer)


def _who(peer: int | None) -> str:
    return f"peer rank {peer}" if peer is not None else "a peer rank"


def _lost(message: str, peer: int | None) -> PeerLost:
    return PeerLost(message, peer=peer)


def _timed_out(what: str, timeout_s: float, text: str) -> SyncTimeout:
    return SyncTimeout(f"{what}: no completion within timeout_s = {timeout_s} ({text})")


def _future(work: dist.Work) -> torch.futures.Future[object] | None:
    """The work's future; None for works that have none (gloo's send/recv)."""
    try:
        return work.get_future()
    except RuntimeError:
        return None


class DeferredWork(dist.Work):
    """A transfer queued behind device work and not issued yet (the host
    carrier's send waiting for its copy to pinned memory:
    ppsync.core.codec.carriers). Waiting on one while it is not issued would
    wait on the device: the in-flight bound never does (its buffers are the
    carrier's, bounded by how far the host runs ahead of the device)."""

    @property
    def issued(self) -> bool:
        raise NotImplementedError


def has_ended(work: dist.Work) -> bool:
    """Whether ``work`` has ended (completed or failed), judged by its future.

    torch marks a gloo work's future done, and runs its callbacks, before the
    work itself reports ``is_completed()``: a caller woken by a callback that
    then asked the work would find it incomplete and block in ``wait()``."""
    fut = _future(work)
    done: bool = work.is_completed() if fut is None else fut.done()
    return done


def ended_well(work: dist.Work) -> bool:
    """True when ``work`` has ended without an error; False when it has not
    ended, or failed: then :func:`wait_work` waits or raises. One future
    read (``value()``: unlike ``wait()``, it orders no stream), the usual
    case of a wait on a transfer already done."""
    fut = _future(work)
    if fut is None or not fut.done():
        return False
    try:
        fut.value()
    except RuntimeError:
        return False
    return True


def has_future(work: dist.Work) -> bool:
    """Whether ``work`` has a future (gloo's send and recv have none)."""
    return _future(work) is not None


def wait_work(work: dist.Work, *, timeout_s: float, what: str, peer: int | None) -> None:
    """Wait for ``work`` at most ``timeout_s``; raise SyncTimeout / PeerLost.
    Never blocks once :func:`has_ended` says the work ended. A work without
    a future (gloo's send and recv) is waited once, by its owner: a second
    ``wait()`` on a finished gloo recv waits for another message, and its
    timeout closes every connection of the group. gloo's rule (a
    future done = the transfer done): a token path asks its completion
    semantics (ppsync.core.wire.completion), which use this on gloo."""
    try:
        fut = _future(work)
        if fut is not None and fut.done():
            # returns at once, or raises the transfer's error; orders no
            # stream (a caller that wants that asks its completion semantics:
            # ppsync.core.wire.completion, order_after on its side stream)
            fut.value()
        else:
            # at least 1 ms: a zero timeout is c10d's "no timeout" (wait for ever)
            work.wait(timeout=datetime.timedelta(seconds=max(timeout_s, 0.001)))
    except RuntimeError as e:
        raise translate(e, what=what, timeout_s=timeout_s, peer=peer) from e
