"""What a token group's work means: its completion semantics (docs/design.md,
"What a work means"), one object per group, chosen once.

- :class:`HostCompleted` (gloo): a work's future completes when the transfer
  has ended, successfully or not; the host may wait on it (bounded) and read
  its buffers afterwards.
- :class:`StreamOrdered` (NCCL, XCCL; and ppsync's CPU twin of them,
  ppsync.core.wire.completion.twin): a work's future is complete right after the
  collective was *enqueued*; ``Future.wait()`` / ``Work.wait()`` make the
  *current* stream wait on the collective on the device and never block the
  host; only ``work.is_completed()`` (an event query) says the transfer
  ended. So here nothing calls either wait except :meth:`order_after`, which
  the device codec calls with its side stream current; whether a transfer
  ended is polled (``is_completed()``) against the same deadlines as on gloo;
  and a deadline aborts the group (:meth:`abort`) so no stream spins on a
  transfer that will never come; from then on every work of the group
  counts as failed with the deadline's error (:attr:`StreamOrdered.cause`),
  whatever the backend reports after its abort.

The token path, its waits and the async services ask the object; none of
them asks which one they got.
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Protocol

import torch.distributed as dist

from ppsync.core.wire.backends import backend as backend_facts
from ppsync.core.wire.platform import Platform
from ppsync.core.wire.teardown import bound_group_timeout, native_call
from ppsync.core.wire.transport import Broadcaster, ended_well, has_ended, translate, wait_work
from ppsync.errors import DesyncError, PeerLost, PPSyncError, SyncTimeout

POLL_FIRST_S = 50e-6
"""First pause between two polls of a stream-ordered work's end; it doubles
up to :data:`POLL_MAX_S` (a pause releases the CPU: polling never spins)."""
POLL_MAX_S = 2e-3

GLOO_TIMEOUT_MARGIN_S = backend_facts("gloo").timeout_margin_s
"""A gloo token group's own timeout is ``max_pending_s`` plus this. gloo
counts its timeout from the post and, when it passes, closes every
connection of the group's context: a peer still waiting then sees
"Connection closed by peer", a lost connection. ppsync's cap comes first,
its notice goes on the failure board, and the others read it long before."""

NCCL_TIMEOUT_MARGIN_S = backend_facts("nccl").timeout_margin_s
"""A stream-ordered token group's own timeout is ``max_pending_s`` plus
this: ppsync's cap (and its abort) comes first and names the fault; the
backend's watchdog is the last resort."""


class Completion(Protocol):
    """When a group's transfer has ended, and how a stream is ordered after it."""

    name: str
    """"host-completed" or "stream-ordered" (as reports and dumps say it)."""
    cause: PPSyncError | None
    """Why the group was aborted; None while it was not (always, on gloo)."""
    stream_ordered: bool
    device_only: bool
    """The backend takes device tensors only (the host codec cannot run)."""

    def ended(self, work: dist.Work) -> bool:
        """Whether the transfer has ended (completed or failed); never blocks."""

    def ended_well(self, work: dist.Work) -> bool:
        """Ended without an error (False: not ended, or failed); never blocks
        and never orders a stream."""

    def wait(self, work: dist.Work, *, timeout_s: float, what: str, peer: int | None) -> None:
        """Return once the transfer ended, at most ``timeout_s`` later; raise
        SyncTimeout / PeerLost. The host's wait only: no stream is ordered."""

    def order_after(self, work: dist.Work) -> None:
        """Order the *current* stream after the transfer (the device codec's
        side stream, once :meth:`wait` returned or the receive is consumed)."""

    def abort(self, group: dist.ProcessGroup, cause: PPSyncError) -> None:
        """A deadline passed with transfers pending (``cause``): every work
        of the group counts as failed with it from now on, and the backend's
        pending transfers are ended, so no stream waits forever; returns at
        once (nothing to do where the host waits)."""

    def adopt(self, work: dist.Work) -> dist.Work:
        """A work issued on the group outside the frames (the handshake's),
        as this object judges it."""

    def broadcaster(self, group: dist.ProcessGroup, root: int) -> Broadcaster:
        """What issues the group's frames from group rank ``root``."""

    def platform(self, platform: Platform) -> Platform:
        """The platform a token path over the group uses, given the device's."""

    def group_timeout_s(self, max_pending_s: float) -> float:
        """The token group's own timeout for a path whose transfers may stay
        pending ``max_pending_s``."""

    def bind(self, group: dist.ProcessGroup, max_pending_s: float, platform: Platform) -> None:
        """``group`` serves a path whose transfers may stay pending
        ``max_pending_s``: set the group's own timeout above it
        (:meth:`group_timeout_s`)."""


class _OwnGroup:
    """A group's own works, broadcasts and platform, as they are (the CPU
    twin replaces them)."""

    def adopt(self, work: dist.Work) -> dist.Work:
        return work

    def broadcaster(self, group: dist.ProcessGroup, root: int) -> Broadcaster:
        return Broadcaster(group, root)

    def platform(self, platform: Platform) -> Platform:
        return platform


class HostCompleted(_OwnGroup):
    """gloo: a work's future completes with the transfer (see the module)."""

    name = "host-completed"
    cause: PPSyncError | None = None
    stream_ordered = False
    device_only = False

    def ended(self, work: dist.Work) -> bool:
        return has_ended(work)

    def ended_well(self, work: dist.Work) -> bool:
        return ended_well(work)

    def wait(self, work: dist.Work, *, timeout_s: float, what: str, peer: int | None) -> None:
        wait_work(work, timeout_s=timeout_s, what=what, peer=peer)

    def order_after(self, work: dist.Work) -> None:
        # ended already (the host waited): for device tensors the future's
        # wait makes the current stream wait on gloo's copies; CPU: nothing
        work.get_future().wait()

    def abort(self, group: dist.ProcessGroup, cause: PPSyncError) -> None:
        """Nothing: gloo ends its works at the group's timeout by itself."""

    def group_timeout_s(self, max_pending_s: float) -> float:
        return max_pending_s + GLOO_TIMEOUT_MARGIN_S

    def bind(self, group: dist.ProcessGroup, max_pending_s: float, platform: Platform) -> None:
        bound_group_timeout(group, self.group_timeout_s(max_pending_s))


class StreamOrdered(_OwnGroup):
    """NCCL / XCCL: a work's future completes at enqueue (see the module).

    Its end is ``is_completed()`` only; its failure is never read back from
    the work: ``Work.exception()`` raises TypeError on the torch releases
    vLLM ships (before PyTorch PR #184697) and is deprecated after it, and
    after ``ncclCommAbort`` NCCL reports pending works completed, without an
    error, their buffers unfilled. So the error that made the path abort is
    kept here (:attr:`cause`): from then on every work of the group counts as
    failed with it, and no buffer of the group is read again."""

    name = "stream-ordered"
    stream_ordered = True
    device_only = True

    def __init__(self, backend: str = "nccl") -> None:
        self.backend = backend
        self.can_abort = backend_facts(backend).abortable
        """Whether the backend can abort a communicator (XCCL cannot)."""
        self.cause: PPSyncError | None = None
        """The error the group was aborted for (None: not aborted)."""
        self.aborter: threading.Thread | None = None
        """The thread that runs the backend's abort (it may block, for ever)."""
        self._lock = threading.Lock()

    def bind(self, group: dist.ProcessGroup, max_pending_s: float, platform: Platform) -> None:
        bound_group_timeout(group, self.group_timeout_s(max_pending_s))

    def ended(self, work: dist.Work) -> bool:
        if self.cause is not None:
            return True  # failed with the cause: nothing of the group is awaited again
        done: bool = work.is_completed()  # the end event's query
        return done

    def failure(self, work: dist.Work) -> BaseException | None:
        """The error an ended work failed with, or None: the abort's cause,
        else what the backend's watchdog reported (``get_future_result()``,
        where the backend has it). A failure the watchdog has not reported
        yet reads as none: the frame's own checks (seq, digest, checksum)
        stand behind it, and NCCL's error handling ends the process."""
        if self.cause is not None:
            return self.cause
        return watchdog_failure(work)

    def ended_well(self, work: dist.Work) -> bool:
        return self.cause is None and self.ended(work) and self.failure(work) is None

    def wait(self, work: dist.Work, *, timeout_s: float, what: str, peer: int | None) -> None:
        deadline = time.monotonic() + timeout_s
        pause = POLL_FIRST_S
        while not self.ended(work):
            left = deadline - time.monotonic()
            if left <= 0:
                raise SyncTimeout(f"{what}: no completion within timeout_s = {timeout_s}")
            time.sleep(min(pause, left))
            pause = min(pause * 2, POLL_MAX_S)
        exc = self.failure(work)
        if exc is self.cause and exc is not None:
            raise aborted_error(exc, what)
        if exc is not None:
            raise translate(exc, what=what, timeout_s=timeout_s, peer=peer) from exc

    def order_after(self, work: dist.Work) -> None:
        work.wait()  # device-side: the current stream waits; the host does not

    def abort(self, group: dist.ProcessGroup, cause: PPSyncError) -> None:
        """Fail every work of the group with ``cause`` at once, and end the
        backend's pending kernels from a daemon thread (never joined: the
        backend's abort may block its caller, for ever). XCCL cannot abort:
        the path is dead, its group is never used again, ``cause`` says so."""
        with self._lock:  # two threads may abort at once (the engine's, the watcher)
            if self.cause is not None:
                return
            self.cause = cause
        self._gave_up()
        if not self.can_abort:
            cause.add_note(f"{self.backend} cannot abort a communicator: the token group keeps "
                           "its pending operations and this path is dead; recovering needs "
                           "a process restart")
            return
        self.aborter = threading.Thread(target=self._abort_group, args=(group,),
                                        name="ppsync-abort", daemon=True)
        self.aborter.start()

    def _gave_up(self) -> None:
        """The path gave the group up (the CPU twin's streams stop waiting)."""

    def _abort_group(self, group: dist.ProcessGroup) -> None:
        # ProcessGroup.abort() aborts every backend of the group
        # (ProcessGroupNCCL: ncclCommAbort); distributed_c10d's
        # _abort_process_group also unregisters the group, which the path
        # does not want (its dumps and messages still name the group)
        with native_call(), contextlib.suppress(RuntimeError):  # nothing else to do: the
            group.abort()  # cause stands; the process's exit waits (bounded) for the abort

    def group_timeout_s(self, max_pending_s: float) -> float:
        return max_pending_s + NCCL_TIMEOUT_MARGIN_S


def aborted_error(cause: PPSyncError, what: str) -> PPSyncError:
    """``cause`` as a later call on an aborted path raises it: its type (and
    its peer, or its views) with ``what`` in front."""
    text = f"{what}: the token group was aborted earlier: {cause}"
    if isinstance(cause, SyncTimeout | PeerLost):
        return type(cause)(text, peer=cause.peer)
    if isinstance(cause, DesyncError):
        return DesyncError(text, expected=cause.expected, received=cause.received)
    return PeerLost(text)


_SUCCESS = 0
"""``WorkResult.SUCCESS`` (c10d's enum: SUCCESS, TIMEOUT, COMM_ERROR, UNKNOWN)."""


def watchdog_failure(work: dist.Work) -> BaseException | None:
    """What the backend's watchdog reported for ``work``: an error for a
    result other than success, None where it said success, has not said
    yet, or has no such result (gloo; torch before it)."""
    try:
        fut = getattr(work, "get_future_result")()  # noqa: B009 (not in torch's stubs)
    except (AttributeError, RuntimeError):
        return None
    if not fut.done():
        return None
    result = int(fut.value())
    if result == _SUCCESS:
        return None
    return RuntimeError(f"the backend's watchdog reported the collective failed "
                        f"(WorkResult {result})")
