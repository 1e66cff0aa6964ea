"""A CPU twin of stream-ordered backends (NCCL, XCCL): gloo ranks whose works
behave as theirs, with CPU stand-ins for streams and events that record which
stream waited on what (ppsync.core.wire.completion.twin_streams; ``ppsync
launch/run --emulate nccl|xccl``; the suites run in this mode too). It
exists because NCCL refuses two ranks on one GPU, so the GPU machines
available for checks cannot run the multi-rank device path at all
(docs/design.md, "The CPU twin").

What it reproduces, as PyTorch's ProcessGroupNCCL / ProcessGroupXCCL behave:

- a work's future is complete at enqueue (:class:`TwinFuture`), so callbacks
  fire at once and ``done()`` says nothing about the transfer;
- ``Work.wait()`` and ``Future.wait()`` are device-side: the *current* stream
  waits for the transfer, the host does not;
- ``work.is_completed()`` is the truth (here: gloo's own completion); the
  rest of ``Work``'s bindings (``exception()`` among them, which raises
  TypeError on torch before PyTorch PR #184697) are torch's own;
- ``get_future_result()`` is what NCCL's watchdog reports: a transfer that
  failed on gloo reads as a communication error;
- a collective is enqueued on the current stream: the gloo op is issued when
  that stream reaches it (:class:`TwinBroadcaster`);
- NCCL's abort (``ncclCommAbort``) may block its caller, here for
  ``abort_hang_s`` (for ever: ``inf``); once it returned, every pending work
  reports completed, without an error, and a pending receive's buffer is
  left unfilled (here: filled with :data:`POISON`), as NCCL's kernels exit;
- NCCL's watchdog: a work pending longer than the group's timeout, counted
  from its post, terminates the process (``TORCH_NCCL_ASYNC_ERROR_HANDLING=3``,
  torch's default), unless the group was aborted first;
- XCCL cannot abort (``abortComms`` only logs): its works stay pending.

With the host carrier (``SyncConfig.carrier = "host"``, the default on an
accelerator) frames do not travel on NCCL or XCCL at all: a twin group
registered with ``carrier="host"`` is plain gloo (host-completed,
:class:`TwinHostCarried`) under the same stand-in streams, so the device
codec's copies to and from pinned memory are ordered as a device orders
them.
"""

from __future__ import annotations

import _thread
import math
import os
import resource
import signal
import sys
import threading
import time
import weakref
from typing import Any, get_args

import torch
import torch.distributed as dist

from ppsync.core.wire.backends import CARRIERS
from ppsync.core.wire.backends import backend as backend_facts
from ppsync.core.wire.completion.semantics import HostCompleted, StreamOrdered
from ppsync.core.wire.completion.twin_streams import (
    HANG_S,
    STATS,
    TwinPlatform,
    current_stream,
)
from ppsync.core.wire.platform import Platform
from ppsync.core.wire.teardown import native_call
from ppsync.core.wire.transport import Broadcaster, has_ended
from ppsync.errors import ConfigError
from ppsync.schemas.config import EmulatedName

__all__ = ["EMULATED", "POISON", "STATS", "TwinCompleted", "TwinGroup", "TwinHostCarried",
           "TwinWork", "emulate", "twin_of"]

EMULATED: tuple[str, ...] = get_args(EmulatedName)  # the one list: ppsync.schemas.config
"""What ``--emulate`` accepts."""

POISON = -0x5EB5EB5EB5EB5EB5
"""What an aborted receive's buffer holds on the twin (NCCL leaves it unfilled)."""

_COMM_ERROR = 2  # c10d's WorkResult: SUCCESS, TIMEOUT, COMM_ERROR, UNKNOWN

GLOO_AFTER_WATCHDOG_S = 30.0
"""gloo's own timeout on a twin group comes this long after the modelled
watchdog's: a work that overruns is the watchdog's, as on NCCL."""


class TwinGroup:
    """A gloo group registered as emulating ``backend``."""

    def __init__(self, group: dist.ProcessGroup, backend: str, lag_s: float,
                 abort_hang_s: float, carries: bool = True) -> None:
        self.group = group
        self.backend = backend
        self.carries = carries
        """The frames travel on the twin of the backend (stream-ordered works);
        False: through the host, over gloo (the host carrier)."""
        self.lag_s = lag_s
        self.abort_hang_s = abort_hang_s
        self.abort_requested = False
        """A token path gave the group up (its stand-in streams stop waiting)."""
        self.aborted = False
        """The backend's abort returned: pending works report completed (NCCL)."""
        self.op_timeout_s: float | None = None
        """The group's own timeout (its watchdog's), once a path set it."""
        self.pending: weakref.WeakSet[TwinWork] = weakref.WeakSet()
        self._watching = False
        self._lock = threading.Lock()

    def posted(self, work: TwinWork) -> None:
        with self._lock:
            self.pending.add(work)
            if not self._watching and backend_facts(self.backend).watchdog:
                # a bare thread, as NCCL's watchdog is the backend's, not one
                # of Python's threads (the suites count those)
                self._watching = True
                _thread.start_new_thread(self._watch, ())

    def abort_comms(self) -> None:
        """NCCL's abort, run by the path's abort thread: it may block."""
        if self.abort_hang_s > 0:
            threading.Event().wait(None if math.isinf(self.abort_hang_s) else self.abort_hang_s)
        with native_call():  # tensor ops, on the abort's daemon thread
            for work in list(self.pending):
                if work.buf is not None and not work.root and not work.real_ended():
                    work.buf.fill_(POISON)  # the kernel exited: the data never came
        self.aborted = True

    def _watch(self) -> None:
        """NCCL's watchdog thread, while works are pending (it ends with the
        last, so a process's threads settle as they do on NCCL)."""
        while True:
            time.sleep(0.2)
            now, limit = time.monotonic(), self.op_timeout_s
            with self._lock:
                for work in list(self.pending):
                    if work.is_completed():
                        self.pending.discard(work)
                if not self.pending:
                    self._watching = False
                    return
            for work in list(self.pending):
                if limit is not None and now - work.posted_at > limit:
                    self._terminate(work, now - work.posted_at, limit)

    def _terminate(self, work: TwinWork, ran_s: float, limit_s: float) -> None:
        print(f"[twin of nccl] watchdog caught collective operation timeout: a work "
              f"ran for {ran_s:.1f} s > the group's timeout {limit_s:.1f} s; "
              "TORCH_NCCL_ASYNC_ERROR_HANDLING=3: terminating the process", file=sys.stderr,
              flush=True)
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        os.kill(os.getpid(), signal.SIGABRT)


_TWINS: dict[int, TwinGroup] = {}  # id(group) -> its twin; groups live until exit

LAG_ENV = "PPSYNC_TWIN_LAG_S"
"""The side streams' lag where the caller gives none (an engine's handler
emulating its own group: ``PPSYNC_EMULATE``); unset: 0."""


def _lag_from_env() -> float:
    text = os.environ.get(LAG_ENV, "0")
    try:
        return float(text)
    except ValueError:
        raise ConfigError(f"{LAG_ENV} = {text!r} must be a number of seconds") from None


def emulate(group: dist.ProcessGroup, backend: str = "nccl", *, carrier: str = "device",
            lag_s: float | None = None, abort_hang_s: float = 0.0) -> None:
    """Make a token path over ``group`` (gloo) run as on a device whose
    backend is ``backend`` (one of :data:`EMULATED`): stand-in streams and
    events; with ``carrier`` "device" its works judged and ordered as
    ``backend``'s, with "host" as gloo's (the frames go through pinned
    memory). ``lag_s``: how far its side streams run behind the host (each
    piece of work starts at least that long after it was handed over), as a
    device behind a host that queues ahead (None: :data:`LAG_ENV`'s).
    ``abort_hang_s``: how long NCCL's abort blocks (``inf``: for ever)."""
    if lag_s is None:
        lag_s = _lag_from_env()
    if backend not in EMULATED:
        raise ConfigError(f"emulate = {backend!r} must be one of {', '.join(EMULATED)}")
    if not 0 <= lag_s < HANG_S:
        raise ConfigError(f"lag_s = {lag_s} (or {LAG_ENV}) must lie in [0, {HANG_S})")
    if not abort_hang_s >= 0:
        raise ConfigError(f"abort_hang_s = {abort_hang_s} must be >= 0 (inf: for ever)")
    if carrier not in {c.name for c in CARRIERS}:
        raise ConfigError(f"carrier = {carrier!r} must be one of "
                          f"{', '.join(c.name for c in CARRIERS)}")
    _TWINS.setdefault(id(group), TwinGroup(group, backend, lag_s, abort_hang_s,
                                           carries=carrier == "device"))


def twin_of(group: dist.ProcessGroup) -> TwinGroup | None:
    """The group's twin, if :func:`emulate` registered it."""
    return _TWINS.get(id(group))


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
                 real: dist.Work | None = None, buf: torch.Tensor | None = None) -> None:
        super().__init__()
        self.twin = twin
        self.frame = frame  # a frame's transfer (the handshake's is not)
        self.root = root  # this rank broadcasts it (else: receives it)
        self.buf = buf  # what it fills or sends
        self.consumed = False  # a received frame whose consume ordered a stream after it
        self.real = real  # gloo's work, once the stream reached the issue
        self.posted_at = time.monotonic()  # NCCL's watchdog counts from here
        self._future = TwinFuture(self)
        twin.posted(self)

    def given_up(self) -> bool:
        return self.twin.abort_requested

    def real_ended(self) -> bool:
        real = self.real
        return real is not None and has_ended(real)

    def is_completed(self) -> bool:
        return self.twin.aborted or self.real_ended()

    def get_future_result(self) -> torch.futures.Future[Any]:
        """What NCCL's watchdog says of the work: pending, or its result."""
        fut: torch.futures.Future[Any] = torch.futures.Future()
        if self.real_ended():
            assert self.real is not None
            try:
                self.real.get_future().value()
                fut.set_result(0)
            except RuntimeError:
                fut.set_result(_COMM_ERROR)
        elif self.twin.aborted:
            fut.set_result(0)  # after ncclCommAbort: completed, no error
        return fut

    def wait(self, timeout: Any = None) -> bool:
        current_stream().wait_work(self)
        return True

    def get_future(self) -> torch.futures.Future[Any]:
        return self._future


class TwinBroadcaster(Broadcaster):
    """Enqueues each frame's broadcast on the current stand-in stream."""

    def __init__(self, twin: TwinGroup, root: int) -> None:
        super().__init__(twin.group, root)
        self.twin = twin
        self.root = twin.group.rank() == root

    def issue(self, buf: torch.Tensor) -> dist.Work:
        work = TwinWork(self.twin, frame=True, root=self.root, buf=buf)

        def issue_now() -> None:
            work.real = self.group.broadcast([buf], self.options)

        current_stream().submit(issue_now)
        return work


class TwinCompleted(StreamOrdered):
    """Stream-ordered semantics over a twin group (NCCL's or XCCL's)."""

    def __init__(self, twin: TwinGroup) -> None:
        super().__init__(twin.backend)
        self.twin = twin
        self.name = f"stream-ordered (twin of {twin.backend})"

    def _abort_group(self, group: dist.ProcessGroup) -> None:
        self.twin.abort_comms()

    def _gave_up(self) -> None:
        self.twin.abort_requested = True

    def adopt(self, work: dist.Work) -> dist.Work:
        return TwinWork(self.twin, frame=False, root=False, real=work)

    def broadcaster(self, group: dist.ProcessGroup, root: int) -> Broadcaster:
        return TwinBroadcaster(self.twin, root)

    def platform(self, platform: Platform) -> Platform:
        if platform.device.type != "cpu":
            raise ConfigError(f"emulate = {self.twin.backend!r} runs on CPU tensors; device = "
                              f"{platform.device} (on a GPU use the real backend)")
        return TwinPlatform(platform.device, self.twin.lag_s)

    def group_timeout_s(self, max_pending_s: float) -> float:
        # NCCL's own timeout is its watchdog's (modelled by the twin); gloo
        # underneath must not end a work first, so its timeout is later
        op_timeout_s = super().group_timeout_s(max_pending_s)
        self.twin.op_timeout_s = op_timeout_s
        return op_timeout_s + GLOO_AFTER_WATCHDOG_S


class TwinHostCarried(HostCompleted):
    """gloo's semantics on a twin group of the host carrier: the works are
    gloo's own, the streams and events the twin's."""

    def __init__(self, twin: TwinGroup) -> None:
        self.twin = twin
        self.name = f"host-completed (the host carrier; twin of a {twin.backend} device)"

    def platform(self, platform: Platform) -> Platform:
        if platform.device.type != "cpu":
            raise ConfigError(f"emulate = {self.twin.backend!r} runs on CPU tensors; device = "
                              f"{platform.device} (on a GPU the real device runs)")
        return TwinPlatform(platform.device, self.twin.lag_s)
