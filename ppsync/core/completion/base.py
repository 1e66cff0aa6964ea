"""What a token group's work means: its completion semantics (docs/design.md,
"What a work means"), one object per group, chosen once.

- :class:`HostCompleted` (gloo): a work's future completes when the transfer
  has ended, successfully or not; the host may wait on it (bounded) and read
  its buffers afterwards.
- :class:`StreamOrdered` (NCCL, XCCL; and ppsync's CPU twin of them,
  ppsync.core.completion.twin): a work's future is complete right after the
  collective was *enqueued*; ``Future.wait()`` / ``Work.wait()`` make the
  *current* stream wait on the collective on the device and never block the
  host; only ``work.is_completed()`` (an event query) says the transfer
  ended. So here nothing calls either wait except :meth:`order_after`, which
  the device codec calls with its side stream current; whether a transfer
  ended is polled (``is_completed()``) against the same deadlines as on gloo;
  and a deadline aborts the group (:meth:`abort`) so no stream spins on a
  transfer that will never come.

The token path, its waits and the async services ask the object; none of
them asks which one they got.
"""

from __future__ import annotations

import contextlib
import time
from typing import Protocol

import torch.distributed as dist

from ppsync.core.platform import Platform
from ppsync.core.transport import Broadcaster, ended_well, has_ended, translate, wait_work
from ppsync.errors import SyncTimeout

POLL_FIRST_S = 50e-6
"""First pause between two polls of a stream-ordered work's end; it doubles
up to :data:`POLL_MAX_S` (a pause releases the CPU: polling never spins)."""
POLL_MAX_S = 2e-3

NCCL_TIMEOUT_MARGIN_S = 30.0
"""A stream-ordered token group's own timeout is ``timeout_s`` plus this:
ppsync's deadline (and its abort) comes first and names the fault; the
backend's watchdog is the last resort."""


class Completion(Protocol):
    """When a group's transfer has ended, and how a stream is ordered after it."""

    name: str
    """"host-completed" or "stream-ordered" (as reports and dumps say it)."""
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

    def abort(self, group: dist.ProcessGroup) -> None:
        """A deadline passed with transfers pending: end them, so no stream
        waits forever (nothing to do where the host waits)."""

    def adopt(self, work: dist.Work) -> dist.Work:
        """A work issued on the group outside the frames (the handshake's),
        as this object judges it."""

    def broadcaster(self, group: dist.ProcessGroup, root: int) -> Broadcaster:
        """What issues the group's frames from group rank ``root``."""

    def platform(self, platform: Platform) -> Platform:
        """The platform a token path over the group uses, given the device's."""

    def group_timeout_s(self, timeout_s: float) -> float:
        """The token group's own timeout for a path whose deadline is ``timeout_s``."""


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

    def abort(self, group: dist.ProcessGroup) -> None:
        """Nothing: gloo ends its works at the group's timeout by itself."""

    def group_timeout_s(self, timeout_s: float) -> float:
        # an abandoned gloo work then ends no later than the path's own deadline
        return timeout_s


class StreamOrdered(_OwnGroup):
    """NCCL / XCCL: a work's future completes at enqueue (see the module)."""

    name = "stream-ordered"
    stream_ordered = True
    device_only = True

    def ended(self, work: dist.Work) -> bool:
        done: bool = work.is_completed()  # the end event's query
        return done

    def failure(self, work: dist.Work) -> BaseException | None:
        """The error an ended work failed with, or None."""
        try:
            exc: BaseException | None = work.exception()
        except RuntimeError as e:  # a backend that answers by raising it
            return e
        return exc

    def ended_well(self, work: dist.Work) -> bool:
        return self.ended(work) and self.failure(work) is None

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
        if exc is not None:
            raise translate(exc, what=what, timeout_s=timeout_s, peer=peer) from exc

    def order_after(self, work: dist.Work) -> None:
        work.wait()  # device-side: the current stream waits; the host does not

    def abort(self, group: dist.ProcessGroup) -> None:
        # torch 2.13: ProcessGroup.abort() aborts every backend of the group
        # (ProcessGroupNCCL: ncclCommAbort, pending works end with an error);
        # distributed_c10d._abort_process_group calls it for a subgroup and
        # also unregisters the group, which the path does not want (its
        # dumps and messages still name the group)
        with contextlib.suppress(RuntimeError):  # a backend without abort: its watchdog remains
            group.abort()

    def group_timeout_s(self, timeout_s: float) -> float:
        return timeout_s + NCCL_TIMEOUT_MARGIN_S
