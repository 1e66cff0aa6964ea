"""A CPU twin of stream-ordered backends (NCCL, XCCL): gloo ranks whose works
behave as theirs, with CPU stand-ins for streams and events that record which
stream waited on what (``ppsync launch/run --emulate nccl``; the suites run
in this mode too). It exists because NCCL refuses two ranks on one GPU, so
the GPU machines available for checks cannot run the multi-rank device path
at all (docs/design.md, "The CPU twin").

What it reproduces, as PyTorch's ProcessGroupNCCL / ProcessGroupXCCL behave:

- a work's future is complete at enqueue (:class:`TwinFuture`), so callbacks
  fire at once and ``done()`` says nothing about the transfer;
- ``Work.wait()`` and ``Future.wait()`` are device-side: the *current* stream
  waits for the transfer, the host does not (:meth:`TwinStream.wait_work`);
- ``work.is_completed()`` is the truth (here: gloo's own completion);
- a collective is enqueued on the current stream: the gloo op is issued when
  that stream reaches it (:class:`TwinBroadcaster`);
- a stream is a FIFO that runs later than the host: a side stream is a
  thread that runs the torch work handed to it in order, after whatever it
  waits on (a transfer that never ends hangs it, as a GPU's stream would,
  until the group is aborted); the engine's main stream is the host thread
  itself (CPU ops run eagerly), so a wait put on it blocks the host;
- aborting the group ends every pending work with an error.

And what it counts (:data:`STATS`, per process): every time the engine's
stream is made to wait on a frame's transfer, split by whether the receive
was consumed by then. ``engine_waits_unconsumed`` must stay 0: the engine's
stream waits on step T's transfer only at consume(T), never on a broadcast.
"""

from __future__ import annotations

import queue
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ppsync.core.completion.base import StreamOrdered
from ppsync.core.platform import Platform
from ppsync.core.transport import Broadcaster, has_ended
from ppsync.errors import ConfigError

EMULATED = ("nccl",)
"""What ``--emulate`` accepts (XCCL's works behave as NCCL's)."""

STOP_S = 2.0
"""Longest a token path's close waits for its stand-in stream's thread to end."""

HANG_S = 600.0
"""How long a stand-in stream waits on a transfer before it reports that it
would hang forever (a GPU's stream would; the twin must end its tests)."""


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


class TwinGroup:
    """A gloo group registered as emulating NCCL."""

    def __init__(self, group: dist.ProcessGroup, lag_s: float) -> None:
        self.group = group
        self.lag_s = lag_s
        self.aborted = False


_TWINS: dict[int, TwinGroup] = {}  # id(group) -> its twin; groups live until exit


def emulate(group: dist.ProcessGroup, backend: str = "nccl", *, lag_s: float = 0.0) -> None:
    """Make a token path over ``group`` (gloo) judge and order its works as
    ``backend``'s (one of :data:`EMULATED`). ``lag_s``: how far its side
    streams run behind the host (each piece of work starts at least that long
    after it was handed over), as a device behind a host that queues ahead."""
    if backend not in EMULATED:
        raise ConfigError(f"emulate = {backend!r} must be one of {', '.join(EMULATED)}")
    if not 0 <= lag_s < HANG_S:
        raise ConfigError(f"lag_s = {lag_s} must lie in [0, {HANG_S})")
    _TWINS.setdefault(id(group), TwinGroup(group, lag_s))


def twin_of(group: dist.ProcessGroup) -> TwinGroup | None:
    """The group's twin, if :func:`emulate` registered it."""
    return _TWINS.get(id(group))


# -- works ---------------------------------------------------------------------


class TwinFuture(torch.futures.Future[Any]):
    """Complete at enqueue; ``wait()`` is a device-side wait of the current stream."""

    def __init__(self, work: TwinWork) -> None:
        super().__init__()
        self.work = work
        self.set_result(None)

    def wait(self) -> Any:
        current_stream().wait_work(self.work)
        return super().wait()


class TwinWork(dist.Work):
    """A frame's (or the handshake's) collective as NCCL would report it."""

    def __init__(self, twin: TwinGroup, *, frame: bool, root: bool,
                 real: dist.Work | None = None) -> None:
        super().__init__()
        self.twin = twin
        self.frame = frame  # a frame's transfer (the handshake's is not)
        self.root = root  # this rank broadcasts it (else: receives it)
        self.consumed = False  # a received frame whose consume ordered a stream after it
        self.real = real  # gloo's work, once the stream reached the issue
        self._future = TwinFuture(self)

    def is_completed(self) -> bool:
        real = self.real
        return self.twin.aborted or (real is not None and has_ended(real))

    def exception(self) -> BaseException | None:
        real = self.real
        if real is not None and has_ended(real):
            try:
                real.get_future().value()
            except RuntimeError as e:
                return e
            return None
        if self.twin.aborted:
            return RuntimeError("the token group was aborted (connection aborted)")
        return None

    def wait(self, timeout: Any = None) -> bool:
        current_stream().wait_work(self)
        return True

    def get_future(self) -> torch.futures.Future[Any]:
        return self._future


def _until_ended(work: TwinWork, bound_s: float = HANG_S) -> None:
    """Block this thread until ``work`` ended (polling, releasing the CPU)."""
    deadline = time.monotonic() + bound_s
    pause = 50e-6
    while not work.is_completed():
        if time.monotonic() > deadline:
            raise RuntimeError(f"a stream waited {bound_s} s on a transfer that never "
                               "ended: a GPU's stream would hang here")
        time.sleep(pause)
        pause = min(pause * 2, 2e-3)


# -- streams and events ----------------------------------------------------------


class TwinEvent:
    """Recorded on a stand-in stream: done once the stream reached it."""

    def __init__(self, stream: TwinStream, works: list[TwinWork]) -> None:
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
        self.after: list[TwinWork] = []  # frames' transfers it is ordered after (see _order_after)
        self.error: BaseException | None = None
        self._queue: queue.SimpleQueue[tuple[float, Callable[[], None]]] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        if not main:
            self._thread = threading.Thread(target=self._run, name=f"ppsync-twin-{name}",
                                            daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while True:
            due, fn = self._queue.get()
            if fn is _STOP:
                return
            if (wait_s := due - time.monotonic()) > 0:
                time.sleep(wait_s)
            try:
                fn()
            except Exception as e:  # sticky, as a device error is
                if self.error is None:
                    self.error = e

    def stop(self) -> None:
        """End the stream's thread once it ran what it was handed (a token
        path's close; a transfer it still waits on ends at the group's abort)."""
        if self._thread is not None:
            self._queue.put((0.0, _STOP))
            self._thread.join(STOP_S)

    def raise_error(self) -> None:
        if self.error is not None:
            raise RuntimeError(f"twin stream {self.name}: {self.error}") from self.error

    def submit(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` when the stream reaches it (the main stream: now)."""
        if self.main:
            fn()
        else:
            self._queue.put((time.monotonic() + self.lag_s, fn))

    def wait_work(self, work: TwinWork) -> None:
        """The stream waits (device-side) for ``work``'s transfer."""
        if self.main:
            self._engine_waits([work])
        else:
            STATS.side_waits += 1
            if work.frame and not work.root:
                work.consumed = True  # only a consume orders a side stream after a receive
        if work.frame and work not in self.after:
            self.after.append(work)  # reaches the next event, ended or not
        self.submit(lambda: _until_ended(work))

    def record_event(self) -> TwinEvent:
        event = TwinEvent(self, list(self.after))
        self.after = [w for w in self.after if not w.is_completed()]
        self.submit(event.reach)
        return event

    def wait_event(self, event: TwinEvent) -> None:
        if self.main:
            self._engine_waits(event.works)
        self._order_after(event.works)
        self.submit(lambda: _reached(event))

    def wait_stream(self, other: TwinStream) -> None:
        if other is not self:
            self.wait_event(other.record_event())

    def _order_after(self, works: list[TwinWork]) -> None:
        """Inherit, from an event, the frames' transfers not ended yet: each
        reaches the next event recorded on this stream (what a stream waiting
        on that event inherits in turn)."""
        self.after += [w for w in works if not w.is_completed() and w not in self.after]

    def _engine_waits(self, works: list[TwinWork]) -> None:
        for w in works:
            if not w.frame:
                continue
            if w.consumed:
                STATS.engine_waits_consumed += 1
                continue
            STATS.engine_waits_unconsumed += 1
            if len(STATS.where) < 3:
                STATS.where.append("".join(traceback.format_stack(limit=8)[:-2]))


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


class TwinBroadcaster(Broadcaster):
    """Enqueues each frame's broadcast on the current stand-in stream."""

    def __init__(self, twin: TwinGroup, root: int) -> None:
        super().__init__(twin.group, root)
        self.twin = twin
        self.root = twin.group.rank() == root

    def issue(self, buf: torch.Tensor) -> dist.Work:
        work = TwinWork(self.twin, frame=True, root=self.root)

        def issue_now() -> None:
            work.real = self.group.broadcast([buf], self.options)

        current_stream().submit(issue_now)
        return work


class TwinCompleted(StreamOrdered):
    """Stream-ordered semantics over a twin group."""

    name = "stream-ordered (twin of nccl)"

    def __init__(self, twin: TwinGroup) -> None:
        self.twin = twin

    def abort(self, group: dist.ProcessGroup) -> None:
        self.twin.aborted = True

    def adopt(self, work: dist.Work) -> dist.Work:
        return TwinWork(self.twin, frame=False, root=False, real=work)

    def broadcaster(self, group: dist.ProcessGroup, root: int) -> Broadcaster:
        return TwinBroadcaster(self.twin, root)

    def platform(self, platform: Platform) -> Platform:
        if platform.device.type != "cpu":
            raise ConfigError(f"emulate = 'nccl' runs on CPU tensors; device = "
                              f"{platform.device} (on a GPU use the real backend)")
        return TwinPlatform(platform.device, self.twin.lag_s)
