"""No daemon thread of ppsync is inside a call into torch's C++ when the
interpreter finalizes (ppsync.core.wire.teardown.native_call).

CPython ends a daemon thread that takes the interpreter back during
finalization with ``pthread_exit``; unwinding that through torch's C++
aborts the process: "terminate called without an active exception", rc -6.
CI saw it once on a survivor of the twin of NCCL (``test_fault_exit
[twin-sync-kill1]``): its abort thread, started as the path failed, was
filling a pending receive's buffer as the process exited. That race is
rare; here each site keeps one such call under way, from a daemon thread,
for the whole life of a process whose main thread returns
(``exit_native.py``), so every exit meets one.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("exit_native.py")
ENDS_SUCH_THREADS = sys.version_info < (3, 14)
"""CPython before 3.14 ends a thread that takes the interpreter back during
finalization (3.14 leaves it hanging: python/cpython gh-87135)."""


def _exit_of(site: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), site], capture_output=True, text=True,
                          timeout=60, check=False)


@pytest.mark.timeout(90)
@pytest.mark.skipif(not ENDS_SUCH_THREADS, reason="this CPython does not end a thread that "
                    "takes the interpreter back during finalization (3.14+, gh-87135)")
def test_an_unguarded_call_under_way_at_exit_aborts_the_process() -> None:
    """The hazard itself, on this torch and CPython: why the guard exists,
    and what each case below would show without it."""
    done = _exit_of("bare")
    assert "main returns" in done.stdout, done.stderr[-2000:]
    assert done.returncode == -signal.SIGABRT, (done.returncode, done.stderr[-2000:])
    assert "terminate called" in done.stderr


@pytest.mark.timeout(90)
@pytest.mark.parametrize("site", ["native", "board", "stream", "abort"])
def test_the_exit_waits_for_a_daemon_threads_call_into_torch(site: str) -> None:
    done = _exit_of(site)
    assert "main returns" in done.stdout, done.stderr[-2000:]
    assert "terminate called" not in done.stderr, done.stderr[-2000:]
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])


@pytest.mark.timeout(90)
@pytest.mark.parametrize(("how", "status"), [("return", 0), ("raise", 1), ("status", 3)])
def test_a_call_that_outlives_the_exit_bound_ends_the_process_with_its_status(
        how: str, status: int) -> None:
    """A daemon thread's call into torch that lasts past the exit hook's
    bound (a real ncclCommAbort takes seconds): the hook ends the process
    itself, with the status it was exiting with and its stdout flushed,
    before the call can return into a finalizing interpreter."""
    done = _exit_of(f"outlives-{how}")
    assert "main returns" in done.stdout, done.stderr[-2000:]
    assert "terminate called" not in done.stderr, done.stderr[-2000:]
    assert done.returncode == status, (done.returncode, done.stderr[-2000:])
