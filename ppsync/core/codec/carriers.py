"""How the device codec's frame travels between ranks: the carrier
(``SyncConfig.carrier``, declared in ppsync.core.wire.backends.CARRIERS),
chosen once where the codec is built (:func:`carrier_for`).

- :class:`DeviceCarrier`: the frame itself goes on the device's backend
  (NCCL, XCCL) from a side stream, as vLLM's handler sends its tokens: a
  posted receive is a kernel that waits on the device for its peer.
- :class:`HostCarrier` (the default): no kernel waits on a peer. The last
  rank packs and checks the frame on the device as before, then copies it
  into pinned host memory without blocking, on the side stream after the
  main one; once that copy's event completed the frame goes over the token
  group's gloo transport. A receiver posts a gloo receive into pinned
  memory (no device work at all, so posting D steps early is free); at
  consume the frame is copied to the device on the side stream and checked
  and released there, as before.

Who issues a copied frame: nobody waits on a copy. The send is queued
(:class:`DeferredSend`); :meth:`HostCarrier.pump` issues every queued frame
whose copy's event has completed (``query()``, never a synchronize), in
order, under one lock. The engine's thread pumps at each of the token
path's calls (inline, as TensorRT-LLM moved its relay after a background
thread starved behind GIL-holding native calls deadlocked ranks), and the
rank's watcher pumps between them (ppsync.core.wire.rank_watch), so a frame
goes even when the engine makes no further call (an idle engine). A pinned
buffer is reused only after the copy that filled or read it ended: a
receiver's at its verdict (its event comes after the copy), a sent one's
when its transfer ended (issued only after its copy ended).
"""

from __future__ import annotations

import datetime
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist

from ppsync.core.frame.layout import BufferPool, FrameLayout
from ppsync.core.wire.backends import CARRIERS
from ppsync.core.wire.platform import Platform, StepEvent
from ppsync.core.wire.transport import DeferredWork, has_ended
from ppsync.errors import ConfigError

__all__ = ["CARRIER_CLASSES", "Carrier", "CopyStats", "DeferredSend", "DeviceCarrier",
           "HostCarrier", "carrier_for"]

Issue = Callable[[torch.Tensor], dist.Work]


@dataclass
class CopyStats:
    """What a host carrier saw in this process (the run report shows it)."""

    copy_waits: int = 0
    """Times a thread had to wait for a frame's copy to pinned memory before
    it could issue it (a drain at close waits for the copies first, uncounted):
    must be 0, the engine's thread never waits on a copy."""
    reused_early: int = 0
    """Pinned buffers taken again before the copy that last used them ended: must be 0."""
    built: int = 0
    """Host carriers built in this process (0: no frame went through pinned
    memory; on the CPU the frame is in host memory already)."""
    deferred: int = 0
    """Sends issued after their call returned (their copy had not ended
    then): by a later call's pump or by the watcher."""
    where: list[str] = field(default_factory=list)

    def clear(self) -> None:
        """Back to nothing seen (a process forked from this one)."""
        self.copy_waits = self.reused_early = self.built = self.deferred = 0
        self.where.clear()


STATS = CopyStats()
os.register_at_fork(after_in_child=STATS.clear)  # a rank forked by a test or a launcher


class Carrier(Protocol):
    """A device codec's carrier (see the module)."""

    name: str

    def send(self, p: Platform, main: Any, side: Any, buf: torch.Tensor, n: int,
             issue: Issue) -> tuple[torch.Tensor, dist.Work, StepEvent | None]:
        """Carry the packed frame ``buf`` of ``n`` rows (the side stream
        waits on ``main`` first); (the buffer the transfer reads, its work,
        the event after which ``buf`` is read out, or None: the caller's own)."""

    def post(self, p: Platform, side: Any, n: int, take: Callable[[], torch.Tensor],
             issue: Issue) -> tuple[torch.Tensor, dist.Work]:
        """Post one receive of a frame of ``n`` rows; (what it fills, its work)."""

    def landed(self, p: Platform, side: Any, wire: torch.Tensor,
               take: Callable[[], torch.Tensor]) -> torch.Tensor:
        """The device frame a consume checks (``wire`` itself, or a copy of
        it made on ``side``, the current stream)."""

    def owns(self, buf: torch.Tensor) -> bool:
        """Whether ``buf`` is one of this carrier's own buffers."""

    def give(self, buf: torch.Tensor, after: StepEvent | None) -> None:
        """``buf`` (its own) is free once ``after`` completed (None: now)."""

    def reads_free(self, wire: torch.Tensor) -> bool:
        """Whether the host may read a received ``wire`` without a sync."""

    def pump(self, wait: bool = False) -> None:
        """Issue the sends whose copies ended (the host carrier's); with
        ``wait`` (a drain at close), wait for every queued copy first."""

    def hurry(self) -> bool:
        """Whether a send waits for its copy (the watcher then looks often)."""

    wake: Callable[[], None] | None
    """Called when a send starts to wait for its copy (the rank's watcher
    wakes and pumps until it goes)."""


class DeviceCarrier:
    """The frame itself goes on the device's backend, from the side stream."""

    name = "device"
    wake: Callable[[], None] | None = None

    def send(self, p: Platform, main: Any, side: Any, buf: torch.Tensor, n: int,
             issue: Issue) -> tuple[torch.Tensor, dist.Work, StepEvent | None]:
        p.wait_stream(side, main)  # the frame is packed
        with p.use(side):
            p.before_send(main)
            work = issue(buf)
        return buf, work, None

    def post(self, p: Platform, side: Any, n: int, take: Callable[[], torch.Tensor],
             issue: Issue) -> tuple[torch.Tensor, dist.Work]:
        p.wait_stream(side, p.current_stream())
        with p.use(side):
            buf = take()
            work = issue(buf)
        return buf, work

    def landed(self, p: Platform, side: Any, wire: torch.Tensor,
               take: Callable[[], torch.Tensor]) -> torch.Tensor:
        return wire

    def owns(self, buf: torch.Tensor) -> bool:
        return False

    def give(self, buf: torch.Tensor, after: StepEvent | None) -> None:
        raise AssertionError("the device carrier owns no buffer")  # owns() is False

    def reads_free(self, wire: torch.Tensor) -> bool:
        return wire.device.type == "cpu"

    def pump(self, wait: bool = False) -> None:
        """Nothing waits: the side stream issues each frame."""

    def hurry(self) -> bool:
        return False


class DeferredSend(DeferredWork):
    """A frame's send waiting for its copy to pinned memory: issued by the
    carrier's pump once the copy's event completed. Until then it has no
    future; a wait on it pumps until it is issued (counted: not the normal
    flow), then waits on gloo's work."""

    def __init__(self, carrier: HostCarrier, wire: torch.Tensor, copied: StepEvent,
                 issue: Issue) -> None:
        super().__init__()
        self.carrier = carrier
        self.wire = wire
        self.copied = copied
        self.issue = issue
        self.real: dist.Work | None = None
        self.failed: Exception | None = None
        """The error its issue raised (a group already aborted): the send
        ended with it."""

    @property
    def issued(self) -> bool:
        return self.real is not None or self.failed is not None

    def is_completed(self) -> bool:
        real = self.real
        return self.failed is not None or (real is not None and has_ended(real))

    def get_future(self) -> torch.futures.Future[Any]:
        if self.failed is not None:
            fut: torch.futures.Future[Any] = torch.futures.Future()
            fut.set_exception(self.failed)
            return fut
        real = self.real
        if real is None:
            raise RuntimeError("a send waiting for its copy has no future yet")
        return real.get_future()

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout.total_seconds()
        if not self.issued:
            STATS.copy_waits += 1
            pause = 50e-6
            while not self.issued:
                self.carrier.pump()
                if self.issued:
                    break
                if deadline is not None and time.monotonic() >= deadline:
                    raise RuntimeError("timed out waiting for the frame's copy to pinned "
                                       "memory before its send")
                time.sleep(pause)
                pause = min(2 * pause, 2e-3)
        if self.failed is not None:
            raise self.failed
        assert self.real is not None
        left = None if deadline is None else max(0.001, deadline - time.monotonic())
        if left is None:
            return bool(self.real.wait())
        return bool(self.real.wait(timeout=datetime.timedelta(seconds=left)))


class HostCarrier:
    """The frame goes through pinned host memory over gloo (see the module)."""

    name = "host"

    def __init__(self, platform: Platform, layout: FrameLayout) -> None:
        STATS.built += 1
        self.pool = BufferPool(layout, keep=16, alloc=platform.host_buffer)
        self._ids: set[int] = set()
        self._last_use: dict[int, StepEvent] = {}  # a buffer's last copy, by id
        self._queue: deque[DeferredSend] = deque()
        self._lock = threading.Lock()
        self.wake: Callable[[], None] | None = None

    def _take(self, n: int) -> torch.Tensor:
        buf = self.pool.take(n)
        self._ids.add(id(buf))
        last = self._last_use.pop(id(buf), None)
        if last is not None and not last.query():
            STATS.reused_early += 1
        return buf

    def send(self, p: Platform, main: Any, side: Any, buf: torch.Tensor, n: int,
             issue: Issue) -> tuple[torch.Tensor, dist.Work, StepEvent | None]:
        wire = self._take(n)
        p.wait_stream(side, main)  # the frame is packed

        def copy_out() -> None:
            wire.copy_(buf, non_blocking=True)

        p.run_on(side, copy_out)
        copied = p.record_event(side)
        self._last_use[id(wire)] = copied
        work = DeferredSend(self, wire, copied, issue)
        with self._lock:
            self._queue.append(work)
        self.pump()  # where the copy already ran (CPU), it goes at once
        if not work.issued:
            STATS.deferred += 1
            if self.wake is not None:
                self.wake()  # an idle engine makes no further call: its watcher sends it
        return wire, work, copied

    def pump(self, wait: bool = False) -> None:
        if wait:
            with self._lock:
                queued = list(self._queue)
            for send in queued:
                send.copied.synchronize()  # at close only, never on the hot path
        with self._lock:
            queue = self._queue
            while queue and queue[0].copied.query():
                send = queue.popleft()
                try:
                    send.real = send.issue(send.wire)
                except Exception as exc:  # the send ended with it
                    send.failed = exc

    def hurry(self) -> bool:
        return bool(self._queue)

    def post(self, p: Platform, side: Any, n: int, take: Callable[[], torch.Tensor],
             issue: Issue) -> tuple[torch.Tensor, dist.Work]:
        wire = self._take(n)
        return wire, issue(wire)  # no device work: posting early costs the device nothing

    def landed(self, p: Platform, side: Any, wire: torch.Tensor,
               take: Callable[[], torch.Tensor]) -> torch.Tensor:
        dev = take()

        def copy_in() -> None:
            dev.copy_(wire, non_blocking=True)

        p.run_on(side, copy_in)  # ordered before the check, on the same stream
        return dev

    def owns(self, buf: torch.Tensor) -> bool:
        return id(buf) in self._ids

    def give(self, buf: torch.Tensor, after: StepEvent | None) -> None:
        if after is not None:
            self._last_use[id(buf)] = after
        self._ids.discard(id(buf))
        self.pool.give(buf)

    def reads_free(self, wire: torch.Tensor) -> bool:
        return True  # pinned host memory the transfer filled


CARRIER_CLASSES: dict[str, Callable[[Platform, FrameLayout], Carrier]] = {
    "host": HostCarrier,
    "device": lambda platform, layout: DeviceCarrier(),
}
"""Each carrier of ppsync.core.wire.backends.CARRIERS, by name: its class here."""


def carrier_for(name: str, platform: Platform, layout: FrameLayout) -> Carrier:
    """The carrier ``name`` names: the one place the choice is made. On a
    platform without streams (the CPU) the frame already is in host memory:
    the host carrier's copies would add work and change nothing, so the
    frame goes as it is (the device carrier over the CPU's gloo)."""
    if name not in CARRIER_CLASSES or name not in {c.name for c in CARRIERS}:
        raise ConfigError(f"carrier = {name!r} must be one of "
                          f"{', '.join(c.name for c in CARRIERS)}")
    if not platform.has_streams:
        name = "device"
    return CARRIER_CLASSES[name](platform, layout)
