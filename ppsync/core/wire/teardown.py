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
buffer as the process exited). The same holds for a gloo thread that runs a
Python callback of a work (ppsync.services.awaiting registers how many such
callbacks are still due: :func:`exit_hazard`). So each such call runs
inside :func:`native_call`, and an exit hook waits, at most
``NATIVE_EXIT_S``, until none is running and no callback is due. From then
on a daemon thread that would start one stops where it is, for good, unless
the main thread waits for its result (a board read or post from a later
exit hook: the main thread holds the exit meanwhile, within that wait's own
bound). If one is still running or due after that bound (an abort that
takes seconds, a receive from a peer that is stopped, not dead), the hook
ends the process at once, its output flushed, with the status it was
exiting with (:func:`intended_status`), rather than let it abort.

A group whose token path failed is marked (:func:`mark_aborted`): a new
token path on it is refused, naming why (its transfers may still be
pending underneath; build the new path on a new group).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import datetime
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch.distributed as dist

NATIVE_EXIT_S = 2.0
"""Longest the process's exit waits for daemon threads' calls into torch
(:func:`native_call`) to return and for works' callbacks to run. Those take
micro- to milliseconds; past this (a store that does not answer, an abort
that blocks, a receive from a stopped peer) the process ends at once with
its intended status."""

_kept: set[int] = set()  # id() of groups kept alive
_aborted: dict[int, str] = {}  # id() of groups whose token path failed -> why
_hazards: list[Callable[[], int]] = []  # each: how many callbacks into Python are still due
_status: list[int] = []  # the status ppsync's own entry points exit with, when set


def mark_aborted(group: dist.ProcessGroup, cause: BaseException) -> None:
    """``group``'s token path failed (``cause``): it is kept until exit and
    no new token path is built on it."""
    keep_until_exit(group)
    _aborted.setdefault(id(group), f"{type(cause).__name__}: {cause}".splitlines()[0])


def aborted_cause(group: dist.ProcessGroup) -> str | None:
    """Why ``group``'s token path failed, or None: it did not."""
    return _aborted.get(id(group))


def exit_hazard(due: Callable[[], int]) -> None:
    """``due()`` says how many callbacks into Python (on a thread not
    Python's) may still run: the exit waits for none, within its bound."""
    if due not in _hazards:
        _hazards.append(due)


def exit_status(status: int) -> None:
    """The status this process is about to exit with (an entry point that
    knows it says so): the exit hook ends with it if it must end the
    process itself."""
    _status[:] = [status]


def intended_status() -> int:
    """The status the process was exiting with: one an entry point set
    (:func:`exit_status`); else 1 after an uncaught exception, 0 otherwise.
    (``sys.exit(n)`` leaves no trace an exit hook can read: a host that
    exits so sets it with :func:`exit_status`.)"""
    if _status:
        return _status[0]
    return 1 if getattr(sys, "last_value", None) is not None else 0


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

    def settle(self, bound_s: float) -> bool:
        """No new call starts on a daemon thread; wait (at most
        ``bound_s``) for those under way and for every callback due.
        Whether none is left."""
        deadline = time.monotonic() + bound_s

        def settled() -> bool:
            return self.inside == 0 and not any(due() for due in _hazards)

        with self.cond:
            self.exiting = True
            while not settled():
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                # callbacks are not counted here: look again every few ms
                self.cond.wait(min(left, 0.005))
            return True


_native = _NativeCalls()


def _settle_at_exit() -> None:
    """The exit hook (registered as ppsync loads, so it runs after the exit
    hooks of what loads later: an engine's, the services')."""
    if not _native.settle(NATIVE_EXIT_S):
        end_now(intended_status())


def end_now(status: int) -> None:
    """End the process at once with ``status``, its output flushed first
    (stdout too: engines log there), without the interpreter's finalization."""
    for handler in logging.getLogger().handlers:
        with contextlib.suppress(Exception):
            handler.flush()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            if stream is not None:
                stream.flush()
    os._exit(status)


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
