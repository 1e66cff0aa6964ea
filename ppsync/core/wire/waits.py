"""How a token path waits, and what it raises when a wait fails
(docs/design.md, "Slow is not dead").

A wait is bounded by ``timeout_s`` counted from when the wait began (never
from the transfer's post: a receive posted at step T waits, by design, for
every later stage to run T). It runs in slices of :data:`SLICE_S`; between
slices it asks its path whether the path failed meanwhile (a failure its
watcher found: a silent or lost peer, a notice on the failure board), a
local read, so no store call is ever made on the waiting thread. While it
waits it logs at growing intervals (:data:`REPORT_AT_S`) whom it waits for
and what that peer is doing, as the peer's heartbeat says. A work that has
already ended badly raises at once, with the backend's own message.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Generator, Sequence
from typing import Protocol

import torch
import torch.distributed as dist

from ppsync.core.wire.board import FailureBoard, Relayed, kind_of, verdict
from ppsync.core.wire.completion import Completion
from ppsync.core.wire.heartbeat import Peers
from ppsync.core.wire.transport import DeferredWork, TransportClock
from ppsync.errors import DesyncError, PeerLost, PPSyncError, SyncTimeout

SLICE_S = 0.25
"""Longest a waiting thread goes without asking whether its path failed."""
REPORT_AT_S = (10.0, 30.0, 60.0)
"""When a long wait logs whom it waits for (seconds into it); then every minute."""

log = logging.getLogger("ppsync")

Failed = Callable[[PPSyncError, bool], PPSyncError]
"""(error, observed) -> the error to raise; see :func:`named_failure`."""


class WaitWatch(Protocol):
    """What a wait asks of its rank's watcher (ppsync.core.wire.rank_watch)."""

    def begin(self, what: str) -> int:
        """A wait for ``what`` begins (the rank's heartbeat says so); a token."""

    def end(self, token: int) -> None: ...

    def lasting(self) -> None:
        """The wait outlasted its first slice: the watcher looks at the
        board now, and every LOOK_S while the wait lasts (a peer that left
        is named within a look, not a beat)."""

    def describe(self, ranks: Sequence[int]) -> str:
        """What the heartbeats say ``ranks`` are doing, for a message."""

    def failure(self) -> PPSyncError | None:
        """The path's failure once it failed (its watcher's or its own)."""


def next_report(elapsed_s: float, reported: int) -> bool:
    """Whether a wait ``elapsed_s`` long that logged ``reported`` lines is
    due another (at 10 s, 30 s, 60 s, then every minute)."""
    at = (REPORT_AT_S[reported] if reported < len(REPORT_AT_S)
          else REPORT_AT_S[-1] * (reported - len(REPORT_AT_S) + 2))
    return elapsed_s >= at


def wait_slices(what: str, *, timeout_s: float | None, watch: WaitWatch | None,
                peers: Sequence[int], now: Callable[[], float] = time.monotonic,
                keep_waiting: Callable[[], bool] | None = None
                ) -> Generator[float, None, None]:
    """The slices of one wait (shared by the synchronous waits here and the
    event loop's in ppsync.services.awaiting): the path's failure, raised
    as it is, as soon as the watcher set it; SyncTimeout, naming ``peers``
    and what their heartbeats say, once ``timeout_s`` passed since the wait
    began (None: no bound but the path's failure, for a transfer that no
    engine call waits on; ``keep_waiting()`` True at the bound: the wait
    goes on, as the start-up handshake does while every peer is alive); a
    log line at growing intervals."""
    start = now()
    token = None if watch is None else watch.begin(what)
    reported = slices = 0
    try:
        while True:
            if watch is not None and (failure := watch.failure()) is not None:
                raise failure
            slices += 1
            if watch is not None and slices == 2:
                watch.lasting()
            elapsed = now() - start
            if (timeout_s is not None and elapsed >= timeout_s
                    and (keep_waiting is None or not keep_waiting())):
                told = "" if watch is None else f"; {watch.describe(peers)}"
                raise SyncTimeout(f"{what}: no completion within timeout_s = {timeout_s} "
                                  f"of the wait{told}",
                                  peer=peers[0] if len(peers) == 1 else None)
            if watch is not None and next_report(elapsed, reported):
                reported += 1
                log.warning("ppsync: %s: waiting for %.0f s; %s", what, elapsed,
                            watch.describe(peers))
            left = SLICE_S if timeout_s is None or elapsed >= timeout_s else timeout_s - elapsed
            yield max(0.001, min(left, SLICE_S))
    finally:
        if watch is not None and token is not None:
            watch.end(token)


def bounded_wait(work: dist.Work, what: str, *, timeout_s: float, completion: Completion,
                 watch: WaitWatch | None, peers: Sequence[int]) -> None:
    """Wait for ``work`` (as ``completion`` judges its end) under
    :func:`wait_slices`; a work that ended badly raises its own error at
    once (a slice's timeout is told apart from the work's by its end)."""
    if completion.ended(work):
        completion.wait(work, timeout_s=timeout_s, what=what, peer=None)
        return
    for slice_s in wait_slices(what, timeout_s=timeout_s, watch=watch, peers=peers):
        try:
            completion.wait(work, timeout_s=slice_s, what=what, peer=None)
            return
        except SyncTimeout as err:
            if slice_ended(completion, work, err):
                return  # it ended well just after the slice's timeout


def slice_ended(completion: Completion, work: dist.Work, err: SyncTimeout) -> bool:
    """After a slice of a wait on ``work`` raised ``err``: False where only
    the slice's time ran out (the wait goes on); True where the work ended
    well meanwhile (its data arrived as the slice timed out); ``err`` raised
    where the work ended badly (its own error: gloo's timeout, ...)."""
    if not completion.ended(work):
        return False
    if completion.ended_well(work):
        return True
    raise err


def named_failure(err: PPSyncError, board: FailureBoard | None, *, rank: int, settle: bool,
                  observed: bool, peers: Peers | None = None) -> PPSyncError:
    """The error to raise for ``err``: the board's verdict after posting this
    rank's notice; ``err`` itself without a board. ``settle``: first wait (up
    to the board's grace) for the survivors to post; an event loop passes
    False after waiting in its own way. ``observed``: False when this rank
    only read of a failure on the board (it then posts what the board says,
    so every rank posts the same cause). ``peers``: the heartbeats' view
    (a silent rank is named before an alive one)."""
    if board is None:
        return err
    mine = (err if observed else
            verdict(err, board.notices(), [], rank=rank, observed=False, peers=peers))
    views = ({"expected": mine.expected, "received": mine.received}
             if isinstance(mine, DesyncError) else {})
    board.post(kind_of(mine), str(mine), **views)
    lost = board.lost() if settle else board.missing()
    return verdict(err, board.notices(), lost, rank=rank, observed=observed, peers=peers)


class Waits:
    """One token path's waits: bounded from their start, sliced against the
    path's failure, timed into ``clock`` when one is set (a benchmark's),
    each failure turned into the path's error by ``failed``; a transfer's
    end as ``completion`` judges it. ``peers``: the global ranks this rank's
    transfers wait on (a receiver: the last rank; the last rank: the others)."""

    def __init__(self, rank: int, timeout_s: float, failed: Failed, completion: Completion,
                 *, watch: WaitWatch | None, peers: Sequence[int]) -> None:
        self.completion = completion
        self.rank = rank
        self.timeout_s = timeout_s
        self.failed = failed
        self.watch = watch
        self.peers = list(peers)
        self.clock: TransportClock | None = None
        """When set, collects the CPU time of real waits."""

    def wait(self, work: dist.Work, what: str) -> None:
        """Wait at most timeout_s from now (see :func:`bounded_wait`)."""
        if self.clock is None or self.completion.ended(work):
            self._wait(work, what)
            return
        t0 = time.thread_time_ns()
        try:
            self._wait(work, what)
        finally:
            self.clock.wait_ns += time.thread_time_ns() - t0

    def _wait(self, work: dist.Work, what: str) -> None:
        try:
            bounded_wait(work, f"rank {self.rank}: {what}", timeout_s=self.timeout_s,
                         completion=self.completion, watch=self.watch, peers=self.peers)
        except Relayed as e:
            raise self.failed(PeerLost(str(e)), False) from e
        except PPSyncError as e:
            named = self.failed(e, True)
            if named is e:
                raise
            raise named from e

    def for_receive(self, work: dist.Work, seq: int) -> None:
        """:meth:`wait` for frame ``seq``'s receive, unless it already ended well."""
        if not self.completion.ended_well(work):
            self.wait(work, f"receive of frame {seq}")


class InFlight:
    """Transfers issued and not yet known complete, oldest first, with the
    buffers they fill or read: at most ``depth`` are left pending."""

    def __init__(self, depth: int) -> None:
        self.depth = depth
        self._works: deque[tuple[torch.Tensor, dist.Work]] = deque()

    def __len__(self) -> int:
        return len(self._works)

    def add(self, buf: torch.Tensor, work: dist.Work) -> None:
        self._works.append((buf, work))

    def works(self) -> list[dist.Work]:
        """The works held, oldest first (a snapshot: the watcher's)."""
        return [w for _, w in list(self._works)]

    def before_issue(self) -> list[dist.Work]:
        """The works :meth:`prune` would wait on: the oldest beyond ``depth``,
        up to the first not issued yet (never waited on: it waits on the device)."""
        excess = len(self._works) - self.depth
        out = []
        for _, w in list(self._works)[: max(0, excess)]:
            if isinstance(w, DeferredWork) and not w.issued:
                break
            out.append(w)
        return out

    def prune(self, waits: Waits, done: Callable[[torch.Tensor, dist.Work], None]) -> None:
        """Drop completed works (``done(buf, work)`` for each); wait for the
        oldest while more than ``depth`` are held."""
        works, ends = self._works, waits.completion
        while works:
            buf, work = works[0]
            if not ends.ended_well(work):
                if len(works) <= self.depth and not ends.ended(work):
                    break
                if isinstance(work, DeferredWork) and not work.issued:
                    break  # its copy runs on the device: never waited for here
                waits.wait(work, "earlier transfer")  # waits, or raises its failure
            works.popleft()
            done(buf, work)

    def drain(self, waits: Waits) -> None:
        while self._works:
            _, work = self._works.popleft()
            waits.wait(work, "draining transfer")

    def abandoned(self, completion: Completion) -> bool:
        """Whether a work is still pending."""
        return any(not completion.ended(w) for _, w in self._works)

    def clear(self) -> None:
        self._works.clear()
