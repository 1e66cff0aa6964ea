"""Helpers shared by the fault tests (tests/faults): thread and process
checks, a watchdog for rank processes, and outcome files that survive a dead
rank.
"""

from __future__ import annotations

import faulthandler
import json
import os
import sys
import threading
import time
from pathlib import Path


def thread_names() -> list[str]:
    """This process's Python threads, as sorted ``name:ident`` strings."""
    return sorted(f"{t.name}:{t.ident}" for t in threading.enumerate())


def settled_threads(before: list[str], within_s: float = 1.0) -> list[str]:
    """The thread list once it is back to ``before``, or as it is after
    ``within_s`` (a worker thread told to stop may need a moment to return)."""
    deadline = time.monotonic() + within_s
    now = thread_names()
    while now != before and time.monotonic() < deadline:
        time.sleep(0.02)
        now = thread_names()
    return now


def pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` exists (a reaped child does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def write_json(path: Path, data: object) -> None:
    """Write ``data`` as JSON atomically: a reader never sees half a file."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    tmp.rename(path)


def watchdog(seconds: float) -> None:
    """In a rank process: if it is still running after ``seconds``, print every
    thread's stack to stderr and exit, so a hang shows where it is (before
    ``spawn_ranks`` gives up on the whole run at its timeout + 10 s)."""
    faulthandler.dump_traceback_later(seconds, exit=True, file=sys.__stderr__ or sys.stderr)
