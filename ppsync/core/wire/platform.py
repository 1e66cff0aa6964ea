"""Platforms: the few calls that differ between CPU, CUDA and XPU.

The device codec (``ppsync.core.codec.device``) and the token path's device
steps are plain torch ops; only these calls depend on where the frame lives:

- the collective backend (gloo / nccl / xccl);
- the current (engine's main) stream, a side stream, ``wait_stream``,
  recording an event on a stream, ``event.query()``, ``stream.wait_event``;
- ``record_stream`` for a buffer made on one stream and used on another;
- a host staging buffer (pinned where the device has pinned memory), so
  host facts reach the device with ``non_blocking`` copies;
- XPU orders the side stream after the main stream with an explicit event
  before the last rank sends (rule 6), never a host sync;
- :meth:`Platform.capture_safe`: a thread that polls a work's end while the
  engine may capture a CUDA graph does so with the thread-local capture mode;
- XPU engines that turn microbatching off run the ring at depth 1: that
  switch is ``SyncConfig.ring_depth = 1``; :attr:`Platform.ring_depth_hint`
  says which depth the platform's engines use by default.

On CPU every stream call is a no-op and an "event" is done once recorded:
torch ops on CPU tensors run eagerly, so whatever was enqueued has run. A
transfer's own completion is still observed through its work (gloo).
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any, Protocol

import torch

from ppsync.core.wire.backends import BACKENDS, device_backend
from ppsync.errors import ConfigError

PLATFORMS = tuple(b.device_type for b in BACKENDS)  # cpu, cuda, xpu


class StepEvent(Protocol):
    """Marks the end of a step's device work; ``query()`` never blocks."""

    def query(self) -> bool: ...

    def synchronize(self) -> None:
        """Block until done: for close(), never on the hot path."""


class DoneEvent:
    """CPU: ops ran eagerly, so the work before the event is done."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


class DeviceEvent:
    """A CUDA / XPU event recorded on a stream."""

    def __init__(self, event: Any) -> None:
        self.event = event

    def query(self) -> bool:
        done: bool = self.event.query()
        return done

    def synchronize(self) -> None:
        self.event.synchronize()


class Platform:
    """CPU: gloo, no streams, eager ops. The base of the device platforms."""

    name = "cpu"
    ring_depth_hint: int | None = None
    """The ring depth the platform's engines use (None: pp_size)."""
    host_reads_free = True
    """The host may read the device's memory without a sync (CPU tensors:
    ops ran eagerly); False on an accelerator, where a read would wait."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    @property
    def backend(self) -> str:
        """The collective backend of this platform's device
        (ppsync.core.wire.backends)."""
        return device_backend(self.name).name

    @property
    def has_streams(self) -> bool:
        return False

    def current_stream(self) -> Any:
        """The engine's main stream (None on CPU)."""
        return None

    def new_stream(self) -> Any:
        """A side stream for the token path (None on CPU)."""
        return None

    def use(self, stream: Any) -> AbstractContextManager[Any]:
        """Make ``stream`` current for the ops in the block."""
        return nullcontext()

    def wait_stream(self, waiter: Any, waitee: Any) -> None:
        """``waiter`` runs nothing further until ``waitee``'s work so far is done."""

    def record_event(self, stream: Any) -> StepEvent:
        return DoneEvent()

    def wait_event(self, stream: Any, event: StepEvent) -> None:
        """``stream`` waits (device-side) for ``event``."""

    def record_stream(self, tensor: torch.Tensor, stream: Any) -> None:
        """``tensor`` (allocated on another stream) is used on ``stream``:
        its memory is not reused before that use is done."""

    def run_on(self, stream: Any, fn: Callable[[], None]) -> None:
        """Run the torch work ``fn`` on ``stream`` (as enqueued there: a
        stand-in stream may run it later, as a device's would)."""
        with self.use(stream):
            fn()

    def close_stream(self, stream: Any) -> None:
        """A side stream made by :meth:`new_stream` is no longer used."""

    def before_send(self, main: Any) -> None:
        """What the last rank does to the main stream before it sends."""

    def host_buffer(self, words: int) -> torch.Tensor:
        """[words] int64 host staging buffer (pinned on a device)."""
        return torch.empty(words, dtype=torch.int64)

    def capture_safe(self) -> AbstractContextManager[object]:
        """Entered around a poll of a work's end (``is_completed()``, an
        event query) from a thread other than the engine's: see CUDA's."""
        return nullcontext()

    def enter_thread(self) -> None:
        """Called first in a thread of ppsync's own that will touch the
        device (the watcher): make the engine's device current there. A new
        thread starts on device 0, and its first CUDA call there would
        create a context on GPU 0 for a rank that is not on it."""


class _AcceleratorPlatform(Platform):
    """CUDA and XPU: the same calls through ``torch.cuda`` / ``torch.xpu``."""

    host_reads_free = False

    @property
    def _mod(self) -> Any:
        return getattr(torch, self.name)

    @property
    def has_streams(self) -> bool:
        return True

    def current_stream(self) -> Any:
        return self._mod.current_stream(self.device)

    def new_stream(self) -> Any:
        return self._mod.Stream(device=self.device)

    def use(self, stream: Any) -> AbstractContextManager[Any]:
        cm: AbstractContextManager[Any] = self._mod.stream(stream)
        return cm

    def wait_stream(self, waiter: Any, waitee: Any) -> None:
        waiter.wait_stream(waitee)

    def record_event(self, stream: Any) -> StepEvent:
        event = self._mod.Event()
        event.record(stream)
        return DeviceEvent(event)

    def wait_event(self, stream: Any, event: StepEvent) -> None:
        if isinstance(event, DeviceEvent):
            stream.wait_event(event.event)

    def record_stream(self, tensor: torch.Tensor, stream: Any) -> None:
        tensor.record_stream(stream)

    def host_buffer(self, words: int) -> torch.Tensor:
        return torch.empty(words, dtype=torch.int64, pin_memory=True)

    def enter_thread(self) -> None:
        self._mod.set_device(self.device)


class CudaPlatform(_AcceleratorPlatform):
    name = "cuda"

    def capture_safe(self) -> AbstractContextManager[object]:
        # An event query from another thread while the engine's thread
        # captures a CUDA graph in the default (global) mode invalidates the
        # capture; torch's own watchdog polls under the thread-local mode
        return thread_local_capture()


class XpuPlatform(_AcceleratorPlatform):
    name = "xpu"
    ring_depth_hint = 1

    def before_send(self, main: Any) -> None:
        # XPU: the sampler's outputs must be complete before the collective
        # reads them (rule 6). An event recorded on the main stream, waited
        # on by the current (side) stream that issues the collective, orders
        # it device-side; a host sync here would end the CPU / GPU overlap
        # that async scheduling relies on
        event = self._mod.Event()
        event.record(main)
        self._mod.current_stream(self.device).wait_event(event)


@contextmanager
def thread_local_capture() -> Iterator[None]:
    """This thread's CUDA stream-capture mode is thread-local inside the
    block (the driver's ``cuThreadExchangeStreamCaptureMode``), as torch's
    NCCL watchdog does around its queries; where the driver cannot be
    loaded (no CUDA here) the block runs as it is."""
    cuda = _driver()
    if cuda is None:
        yield
        return
    mode = ctypes.c_int(_CAPTURE_THREAD_LOCAL)
    swapped = cuda.cuThreadExchangeStreamCaptureMode(ctypes.byref(mode)) == 0
    try:
        yield
    finally:
        if swapped:
            cuda.cuThreadExchangeStreamCaptureMode(ctypes.byref(mode))


_CAPTURE_THREAD_LOCAL = 1  # CU_STREAM_CAPTURE_MODE_THREAD_LOCAL


@functools.cache
def _driver() -> Any:
    """The CUDA driver library (one per process, whichever runtime torch
    carries), or None where it cannot be loaded."""
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None


_BY_NAME: dict[str, type[Platform]] = {"cpu": Platform, "cuda": CudaPlatform,
                                        "xpu": XpuPlatform}


def _built(kind: str) -> bool:
    """Whether this torch was built with ``kind`` (cuda / xpu) support."""
    if kind == "cuda":
        return torch.version.cuda is not None or torch.version.hip is not None
    xpu = getattr(torch, "xpu", None)
    return bool(xpu is not None and xpu._is_compiled())


def check_accelerator(kind: str, index: int | None = None) -> None:
    """ConfigError unless this torch can run on ``kind`` (cuda / xpu) device
    ``index`` (None: any): built with it, a device visible, the index in range.
    Without it, the first stream or event call would fail later with a raw
    RuntimeError, after peers may have started a collective."""
    if not _built(kind):
        raise ConfigError(f"device {kind}: this torch ({torch.__version__}) was built without "
                          f"{kind.upper()} support; install a {kind.upper()} build of torch or "
                          "use device cpu")
    mod = getattr(torch, kind)
    if not mod.is_available():
        raise ConfigError(f"device {kind}: torch.{kind}.is_available() is False: no {kind} "
                          "device is visible to this process (drivers, "
                          f"{'CUDA' if kind == 'cuda' else 'ZE_AFFINITY_MASK / XPU'} "
                          "visible devices)")
    count = int(mod.device_count())
    if index is not None and not 0 <= index < count:
        raise ConfigError(f"device {kind}:{index}: index out of range; {count} {kind} "
                          f"device(s) are visible (0..{count - 1})")


def platform_for(device: torch.device | str | None, name: str | None = None) -> Platform:
    """The platform of ``device`` (default CPU); ``name`` overrides the choice
    (one of cpu, cuda, xpu). ConfigError for an unknown name or device type,
    and for a cuda / xpu device or platform that this torch cannot run (not
    built with it, no device visible, an index out of range), before
    anything else."""
    dev = torch.device("cpu" if device is None else device)
    for kind in sorted({dev.type, name or dev.type} & {"cuda", "xpu"}):
        check_accelerator(kind, dev.index if kind == dev.type else None)
    mod = getattr(torch, dev.type, None) if dev.type in ("cuda", "xpu") else None
    if dev.index is None and mod is not None and mod.is_available():
        # "cuda" means the current device: tensors report "cuda:N", and the
        # token path compares devices
        dev = torch.device(dev.type, mod.current_device())
    chosen = dev.type if name is None else name
    cls = _BY_NAME.get(chosen)
    if cls is None:
        raise ConfigError(f"platform = {chosen!r} (device {dev}) must be one of "
                          f"{', '.join(PLATFORMS)}")
    return cls(dev)
