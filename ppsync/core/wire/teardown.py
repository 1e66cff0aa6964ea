"""What becomes of a token group whose transfers were abandoned.

A token path closed without draining (after a failure, or when the engine is
cancelled) leaves gloo work in flight that only ends when the peer sends, the
connection breaks, or the group's timeout passes. If nothing is done, the
garbage collector destroys the process group at interpreter exit and gloo's
destructor waits for that work: a survivor of a silent peer then hangs at exit
for the rest of the group's timeout (seen: 25 s after a 5 s SyncTimeout).

So a group with abandoned work is never destroyed: it stays referenced until
the process exits, which reclaims it without waiting. (The async services
also make sure no such work still carries a Python callback when the
interpreter finalizes; see ``ppsync.services.awaiting``.)

Nor may one of ppsync's daemon threads be inside a call into torch's C++
that let go of the interpreter (a tensor op, a store call, a group's abort)
when the interpreter finalizes: CPython ends a thread that takes the
interpreter back then with ``pthread_exit``, whose unwinding through
torch's C++ aborts the process ("terminate called without an active
exception", rc -6; seen on a survivor whose abort thread filled a receive
buffer as the process exited). So each such call runs inside
:func:`native_call`, and an exit hook waits, at most ``NATIVE_EXIT_S``,
until none is running. From then on a daemon thread that would start one
stops where it is, for good, unless the main thread waits for its result (a
board read or post from a later exit hook: the main thread holds the exit
meanwhile, within that wait's own bound).
"""

from __future__ import annotations

import atexit
import ctypes
import datetime
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch.distributed as dist

NATIVE_EXIT_S = 1.0
"""Longest the process's exit waits for daemon threads' calls into torch
(:func:`native_call`) to return. Those calls take micro- to milliseconds; one
that outlives this (a store that does not answer, an abort that blocks) is
left: it returns, if ever, after the process is gone."""

_kept: set[int] = set()  # id() of groups kept alive


def keep_until_exit(group: dist.ProcessGroup) -> None:
    """Never destroy ``group``: process exit reclaims it. A module-level list
    would not do, since module globals are cleared at finalization before the
    last garbage collection; one extra reference that nothing drops does."""
    if id(group) in _kept:
        return
    _kept.add(id(group))
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(group))


def bound_group_timeout(group: dist.ProcessGroup, timeout_s: float) -> None:
    """Make every collective issued on ``group`` from now on end (complete or
    fail) within ``timeout_s``, so no abandoned work outlives the token path's
    own deadline by more than that."""
    group.set_timeout(datetime.timedelta(seconds=timeout_s))


class _NativeCalls:
    """Counts daemon threads' calls into torch under way (see the module)."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.inside = 0
        self.exiting = False

    def enter(self, for_main: bool) -> None:
        with self.cond:
            parked = (self.exiting and not for_main
                      and threading.current_thread() is not threading.main_thread())
            if not parked:
                self.inside += 1
        if parked:
            threading.Event().wait()  # never set: the process exits around this thread

    def leave(self) -> None:
        with self.cond:
            self.inside -= 1
            self.cond.notify_all()

    def settle(self, bound_s: float) -> None:
        """No new call starts on a daemon thread; wait (at most
        ``bound_s``) for those under way."""
        with self.cond:
            self.exiting = True
            self.cond.wait_for(lambda: self.inside == 0, bound_s)


_native = _NativeCalls()


def _settle_at_exit() -> None:
    """The exit hook (registered as ppsync loads, so it runs after the exit
    hooks of what loads later: an engine's, the services')."""
    _native.settle(NATIVE_EXIT_S)


def _forked() -> None:
    """A forked child has none of its parent's threads, nor their calls
    (and one of them may have held the lock)."""
    global _native
    _native = _NativeCalls()


atexit.register(_settle_at_exit)
os.register_at_fork(after_in_child=_forked)


@contextmanager
def native_call(*, for_main: bool = False) -> Iterator[None]:
    """Run the body, a call into torch's C++ made from a daemon thread,
    where the process's exit waits for it (see the module). Once the exit
    has begun, a daemon thread that enters here never returns, unless
    ``for_main``: the main thread waits (bounded) for the call's result."""
    calls = _native
    calls.enter(for_main)
    try:
        yield
    finally:
        calls.leave()
