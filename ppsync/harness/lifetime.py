"""Process lifetimes of a local run: children that end with their parent, and
a parent that ends its children when it is told to stop.

A launcher's ranks and its store process must never outlive it: ``timeout``,
CI runners and ``docker stop`` send SIGTERM to the launcher alone, and a
launcher killed outright (SIGKILL, OOM) runs no cleanup at all. So each child
asks the kernel to kill it when its parent dies (Linux ``PR_SET_PDEATHSIG``)
and also watches its parent's pid (every other platform, and the moment
between fork and the ``prctl`` call), and the launcher turns SIGTERM and
SIGINT into :class:`~ppsync.errors.Stopped`, so that its cleanup runs.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType

from ppsync.errors import Stopped

PARENT_POLL_S = 0.5
"""How often a child looks whether its parent is still there."""
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
_PR_SET_PDEATHSIG = 1
_PR_SET_NAME = 15


def set_process_name(name: str) -> None:
    """Name this process in ``ps -e``, ``top`` and ``/proc/PID/comm`` (Linux:
    the kernel keeps 15 bytes; elsewhere nothing), so that a rank shows its
    role: every rank of a launch has the launcher's command line."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_NAME, name.encode()[:15], 0, 0, 0)


def die_with_parent(parent_pid: int) -> None:
    """Make this child end when ``parent_pid`` (its parent) does: SIGKILL
    from the kernel on Linux, and a daemon thread that watches the parent's
    pid everywhere (re-parented children see another parent pid)."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent_pid:  # the parent died before the prctl call
        os._exit(1)
    threading.Thread(target=_watch, args=(parent_pid,), name="ppsync-parent-watch",
                     daemon=True).start()


def _watch(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(PARENT_POLL_S)
    os._exit(1)


def default_stop_signals() -> None:
    """A forked child inherits the launcher's stop handlers: give it the
    default action back (the signal ends it)."""
    for s in STOP_SIGNALS:
        signal.signal(s, signal.SIG_DFL)


def on_stop_signals(handler: Callable[[int, FrameType | None], object]) -> None:
    """Run ``handler`` on SIGTERM and SIGINT (a child's own way to end)."""
    for s in STOP_SIGNALS:
        signal.signal(s, handler)


class StopGuard:
    """While active, SIGTERM and SIGINT raise :class:`Stopped` in the main
    thread (once; later ones are ignored while the launcher ends its
    children). Does nothing outside the main thread, where no signal handler
    can be set."""

    def __init__(self) -> None:
        self.signum: int | None = None  # the first stop signal seen
        self._held = False
        self._before: dict[int, object] = {}

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is not None:
            return
        self.signum = signum
        if not self._held:
            raise Stopped(f"stopped by {signal.Signals(signum).name}: every rank and the "
                          "store process were ended", signum)

    @contextlib.contextmanager
    def active(self) -> Iterator[StopGuard]:
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        for s in STOP_SIGNALS:
            self._before[s] = signal.signal(s, self._on_signal)
        try:
            yield self
        finally:
            for signum, before in self._before.items():
                signal.signal(signum, before)  # type: ignore[arg-type]

    def hold(self) -> None:
        """From now on a stop signal is only recorded: the children are being
        ended already."""
        self._held = True


def session_processes(sid: int) -> list[tuple[int, str, str]]:
    """(pid, state, name) of the live processes of session ``sid``, by pid
    (Linux /proc; zombies, gone but for their parent's reaping, left out)."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()
        if len(fields) > 3 and fields[0] != "Z" and int(fields[3]) == sid:
            out.append((int(entry.name), fields[0], name))
    return sorted(out)


def kill_session(sid: int, tries: int = 20) -> int:
    """SIGKILL every process of session ``sid`` (its process group, then any
    other process of the session by its id, a stopped one too) until none is
    left, at most ``tries`` rounds 0.1 s apart; the number still alive."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(sid, signal.SIGKILL)
    for _ in range(tries):
        pids = [pid for pid, _, _ in session_processes(sid)]
        if not pids:
            return 0
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.1)
    return len(session_processes(sid))
