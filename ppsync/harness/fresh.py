"""A function run in a fresh interpreter, bounded: what ``make gpu-check``
runs each check in, and the benches run what must not share a process with
later forks (gloo's threads).

The worker is a multiprocessing "spawn" process (CUDA does not survive a
fork) that dies with its parent. It sends its result, or its exception,
through a pipe. When it overruns its bound it is asked for every thread's
stack (SIGUSR1: faulthandler, to stderr), then terminated (SIGTERM: a rank
launcher in it ends its ranks), then killed (SIGKILL) if it is still there
:data:`KILL_GRACE_S` later; the processes it started die with it (they die
with their parent: ppsync.harness.lifetime). Nothing waits on a hung worker
past its bound and that grace.
"""

from __future__ import annotations

import faulthandler
import multiprocessing
import os
import pickle
import signal
import sys
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any, TypeVar

from ppsync.harness.lifetime import die_with_parent

T = TypeVar("T")

KILL_GRACE_S = 5.0
"""How long a terminated worker has to exit before it is killed."""
STACKS_S = 0.5
"""How long an overrun worker has to print its stacks before SIGTERM."""


class Overran(TimeoutError):
    """A worker gave no result within its bound and was ended.
    ``how``: "terminated" (it exited on SIGTERM) or "killed" (SIGKILL)."""

    def __init__(self, message: str, how: str = "ended") -> None:
        super().__init__(message)
        self.how = how


def _child(conn: Connection, ready: Any, parent_pid: int, fn: Callable[..., Any],
           args: tuple[object, ...]) -> None:
    """The worker: run ``fn(*args)``, send ("ok", result) or ("err", the
    exception), leave with os._exit (a backend's threads or destructors, an
    aborted NCCL communicator's say, must not hold the exit). ``ready`` is
    set once SIGUSR1 prints the stacks (before, it would end the worker)."""
    die_with_parent(parent_pid)
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    ready.set()
    code = 0
    try:
        conn.send(("ok", fn(*args), ""))
    except BaseException as e:  # reported to the parent, which re-raises it
        code = 1
        where = f"in the fresh process {os.getpid()}:\n{traceback.format_exc()}"
        try:
            pickle.loads(pickle.dumps(e))  # it must come back as itself
            conn.send(("err", e, where))
        except Exception:  # an exception that does not pickle: its text
            conn.send(("err", RuntimeError(f"{type(e).__name__}: {e}"), where))
    finally:
        conn.close()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _end(proc: Any, *, stacks: bool) -> str:
    """End ``proc`` (first asking for its stacks, with ``stacks``):
    "exited" (it did by itself), "terminated" or "killed"."""
    if stacks and proc.is_alive() and proc.pid is not None:
        try:
            os.kill(proc.pid, signal.SIGUSR1)
            proc.join(STACKS_S)
        except ProcessLookupError:
            pass
    how = "exited"
    if proc.is_alive():
        proc.terminate()
        how = "terminated"
        proc.join(KILL_GRACE_S)
    if proc.is_alive():
        proc.kill()
        how = "killed"
    proc.join()
    return how


def in_fresh_process(fn: Callable[..., T], *args: object, timeout_s: float = 300.0) -> T:
    """``fn(*args)`` in a new interpreter (multiprocessing's spawn): the gloo
    pair's threads then never live in a process that later forks rank
    processes (a forked child inherits gloo's objects without their threads).
    Raises what ``fn`` raised; :class:`Overran` once ``timeout_s`` passed
    (the worker is ended then, see the module); RuntimeError if the worker
    died without a word. ``fn`` and ``args`` must pickle."""
    ctx: Any = multiprocessing.get_context("spawn")
    parent_end, child_end = ctx.Pipe(duplex=False)
    ready = ctx.Event()
    # not a daemon: a check starts rank processes (it dies with this one anyway)
    proc = ctx.Process(target=_child, args=(child_end, ready, os.getpid(), fn, args))
    t0 = time.monotonic()
    proc.start()
    child_end.close()
    try:
        if not parent_end.poll(timeout_s):
            how = _end(proc, stacks=ready.is_set())
            raise Overran(f"no result within {timeout_s:.0f} s: the worker was {how}"
                          + (" (it ignored SIGTERM)" if how == "killed" else ""), how)
        try:
            kind, payload, where = parent_end.recv()
        except EOFError:
            _end(proc, stacks=False)
            raise RuntimeError(f"the worker died after {time.monotonic() - t0:.1f} s "
                               f"without a result (exit code {proc.exitcode})") from None
    finally:
        parent_end.close()
        if proc.is_alive() or proc.exitcode is None:
            proc.join(KILL_GRACE_S)
            _end(proc, stacks=False)
    if kind == "err":
        payload.add_note(where)  # the worker's traceback (a pickled one has none)
        raise payload
    result: T = payload
    return result
