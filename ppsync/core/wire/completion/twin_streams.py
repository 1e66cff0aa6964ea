"""The CPU twin's stand-ins for streams and events (ppsync.core.wire.completion.twin):
a stream is a FIFO that runs later than the host, a side stream a thread
that runs the torch work handed to it in order, after whatever it waits on;
the engine's main stream is the host thread itself (CPU ops run eagerly), so
a wait put on it blocks the host. :data:`STATS` counts every time the
engine's stream is made to wait on a frame's transfer, split by whether the
receive was consumed by then.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from ppsync.core.wire.platform import Platform
from ppsync.core.wire.teardown import native_call

STOP_S = 2.0
"""Longest a token path's close waits for its stand-in stream's thread to end."""

HANG_S = 600.0
"""How long a stand-in stream waits on a transfer before it reports that it
would hang forever (a GPU's stream would; the twin must end its tests)."""


class TwinTransfer(Protocol):
    """What a stand-in stream knows of a transfer it is ordered after
    (ppsync.core.wire.completion.twin.TwinWork)."""

    frame: bool
    """A frame's transfer (the handshake's is not)."""
    root: bool
    """This rank broadcasts it (else: receives it)."""
    consumed: bool
    """A received frame whose consume ordered a stream after it."""

    def is_completed(self) -> bool: ...

    def given_up(self) -> bool:
        """The token path gave the group up: a stand-in may stop waiting."""
        ...


@dataclass
class TwinStats:
    """What the twin saw in this process."""

    engine_waits_unconsumed: int = 0
    """The engine's (main) stream made to wait on a frame's transfer before
    it was consumed, or on a broadcast: must be 0."""
    engine_waits_consumed: int = 0
    """... on a received frame at its consume: the expected ones."""
    side_waits: int = 0
    """Side-stream waits on transfers (device-side)."""
    where: list[str] = field(default_factory=list)
    """Where the first unconsumed waits were made (call stacks, at most 3)."""


STATS = TwinStats()


def _until_ended(work: TwinTransfer, bound_s: float = HANG_S) -> None:
    """Block this thread until ``work`` ended (polling, releasing the CPU)."""
    deadline = time.monotonic() + bound_s
    pause = 50e-6
    while not work.is_completed():
        if work.given_up():
            # a stand-in's liberty: the path gave the group up, so the
            # thread may end (a device's stream would stay where it is)
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"a stream waited {bound_s} s on a transfer that never "
                               "ended: a GPU's stream would hang here")
        time.sleep(pause)
        pause = min(pause * 2, 2e-3)


class TwinEvent:
    """Recorded on a stand-in stream: done once the stream reached it."""

    def __init__(self, stream: TwinStream, works: list[TwinTransfer]) -> None:
        self.stream = stream
        self.works = works  # the frames' transfers the stream was ordered after
        self._reached = threading.Event()

    def reach(self) -> None:
        self._reached.set()

    def query(self) -> bool:
        self.stream.raise_error()
        return self._reached.is_set()

    def synchronize(self) -> None:
        if not self._reached.wait(HANG_S):
            raise RuntimeError("an event was not reached within the twin's hang bound")
        self.stream.raise_error()


class TwinStream:
    """A stand-in stream: the host itself (``main``) or a FIFO thread."""

    def __init__(self, name: str, *, main: bool, lag_s: float = 0.0) -> None:
        self.name = name
        self.main = main
        self.lag_s = lag_s
        self.after: list[TwinTransfer] = []  # transfers it is ordered after (_order_after)
        self.error: BaseException | None = None
        self._queue: queue.SimpleQueue[tuple[float, Callable[[], None], bool]] = (
            queue.SimpleQueue())
        self._thread: threading.Thread | None = None
        if not main:
            self._thread = threading.Thread(target=self._run, name=f"ppsync-twin-{name}",
                                            daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while True:
            due, fn, native = self._queue.get()
            if fn is _STOP:
                return
            if (wait_s := due - time.monotonic()) > 0:
                time.sleep(wait_s)
            try:
                # torch work: the process's exit waits for it (a wait, only
                # the host clock and queries, need not hold the exit up)
                with native_call() if native else contextlib.nullcontext():
                    fn()
            except Exception as e:  # sticky, as a device error is
                if self.error is None:
                    self.error = e

    def stop(self) -> None:
        """End the stream's thread once it ran what it was handed (a token
        path's close; a transfer it still waits on ends at the group's abort)."""
        if self._thread is not None:
            self._queue.put((0.0, _STOP, False))
            self._thread.join(STOP_S)

    def raise_error(self) -> None:
        if self.error is not None:
            raise RuntimeError(f"twin stream {self.name}: {self.error}") from self.error

    def submit(self, fn: Callable[[], None], *, native: bool = True) -> None:
        """Run ``fn`` when the stream reaches it (the main stream: now);
        ``native``: it calls into torch (not only waits)."""
        if self.main:
            fn()
        else:
            # a device stream's work runs in the submitting thread's autograd
            # state; this stand-in's thread has its own: vLLM steps under
            # torch.inference_mode(), where tensors made then may be updated
            # in place only under it
            self._queue.put((time.monotonic() + self.lag_s,
                             _in_mode(torch.is_inference_mode_enabled(), fn), native))

    def wait_work(self, work: TwinTransfer) -> None:
        """The stream waits (device-side) for ``work``'s transfer."""
        if self.main:
            self._engine_waits([work])
        else:
            STATS.side_waits += 1
            if work.frame and not work.root:
                work.consumed = True  # only a consume orders a side stream after a receive
        if work.frame and work not in self.after:
            self.after.append(work)  # reaches the next event, ended or not
        self.submit(lambda: _until_ended(work), native=False)

    def record_event(self) -> TwinEvent:
        event = TwinEvent(self, list(self.after))
        self.after = [w for w in self.after if not w.is_completed()]
        self.submit(event.reach, native=False)
        return event

    def wait_event(self, event: TwinEvent) -> None:
        if self.main:
            self._engine_waits(event.works)
        self._order_after(event.works)
        self.submit(lambda: _reached(event), native=False)

    def wait_stream(self, other: TwinStream) -> None:
        if other is not self:
            self.wait_event(other.record_event())

    def _order_after(self, works: list[TwinTransfer]) -> None:
        """Inherit, from an event, the frames' transfers not ended yet: each
        reaches the next event recorded on this stream (what a stream waiting
        on that event inherits in turn)."""
        self.after += [w for w in works if not w.is_completed() and w not in self.after]

    def _engine_waits(self, works: list[TwinTransfer]) -> None:
        for w in works:
            if not w.frame:
                continue
            if w.consumed:
                STATS.engine_waits_consumed += 1
                continue
            STATS.engine_waits_unconsumed += 1
            if len(STATS.where) < 3:
                STATS.where.append("".join(traceback.format_stack(limit=8)[:-2]))


def _in_mode(inference: bool, fn: Callable[[], None]) -> Callable[[], None]:
    def run() -> None:
        with torch.inference_mode(inference):
            fn()

    return run


def _STOP() -> None:
    """Queued by :meth:`TwinStream.stop`: the thread returns."""


def _reached(event: TwinEvent) -> None:
    if not event._reached.wait(HANG_S):
        raise RuntimeError("a stream waited on an event that was never reached")


MAIN = TwinStream("main", main=True)
"""The engine's stream: the host thread (CPU ops run eagerly)."""

_local = threading.local()


def current_stream() -> TwinStream:
    """The stand-in stream current on this thread (the main one by default)."""
    stream: TwinStream = getattr(_local, "stream", MAIN)
    return stream


@contextmanager
def _using(stream: TwinStream) -> Iterator[TwinStream]:
    before = current_stream()
    _local.stream = stream
    try:
        yield stream
    finally:
        _local.stream = before


class TwinPlatform(Platform):
    """The CPU platform with stand-in streams and events (see the module);
    side streams run ``lag_s`` behind the host."""

    def __init__(self, device: torch.device, lag_s: float = 0.0) -> None:
        super().__init__(device)
        self.lag_s = lag_s

    @property
    def has_streams(self) -> bool:
        return True

    def current_stream(self) -> TwinStream:
        return current_stream()

    def new_stream(self) -> TwinStream:
        return TwinStream("side", main=False, lag_s=self.lag_s)

    def use(self, stream: Any) -> Any:
        return _using(stream)

    def wait_stream(self, waiter: Any, waitee: Any) -> None:
        waiter.wait_stream(waitee)

    def record_event(self, stream: Any) -> TwinEvent:
        event: TwinEvent = stream.record_event()
        return event

    def wait_event(self, stream: Any, event: Any) -> None:
        stream.wait_event(event)

    def run_on(self, stream: Any, fn: Callable[[], None]) -> None:
        stream.submit(fn)

    def close_stream(self, stream: Any) -> None:
        stream.stop()


