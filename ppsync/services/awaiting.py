"""Observing a transfer's completion from the event loop, by notification.

Gloo completes work on its own threads. Handing each wait to a worker thread
costs a large share of a step, and polling starves gloo's threads
(docs/measured.md). So: check :func:`has_ended`
first (in the pipelined flow a slot's transfer has usually completed by the
time it is consumed, D steps later, and then nothing wakes at all); otherwise
register a done-callback on the work's future that hands ``Event.set`` to the
loop through its thread-safe entry point (asyncio's ``call_soon_threadsafe``,
trio's ``TrioToken.run_sync_soon``) and await the event under a deadline.

The hand-off itself costs the loop a wake-up through its self-pipe and a
scheduling round (docs/measured.md). Most transfers that are still pending
when awaited end soon after, so before handing off
the loop thread first waits inline, at most ``INLINE_WAIT_S`` (50 µs), on a
``threading.Event`` the same callback sets: a futex sleep that releases the
GIL (no polling, which would starve gloo's threads). Done within the bound:
no hand-off at all. Otherwise the loop awaits as before, and the callback
wakes it. So the loop thread is blocked at most ``INLINE_WAIT_S`` per
:func:`await_work` call, once (tests/services/test_async_inline_wait.py counts
the inline waits and their bounds on a real run).

A torch future's ``add_done_callback`` runs the callback at once, in the
calling thread, when the future is already complete; the hand-off then simply
schedules ``set`` on this same loop, which is harmless.

A callback cannot be taken back, and one that fires while the interpreter is
finalizing kills the process: gloo's thread must take the GIL to run it,
CPython ends such a thread with ``pthread_exit``, and the unwinding through
gloo aborts ("terminate called after throwing an instance of
'gloo::IoException'", rc -6; seen when a peer closed its connections as a
survivor of a failure was exiting). So every work given a callback is
remembered until its callback has returned (a work reads as ended a moment
before its callbacks run), and an exit hook waits, at most
``EXIT_GRACE_S``, for the remembered ones while the interpreter is still
whole. After a failure they end within milliseconds (their peers are gone or
leaving too) or at the token group's timeout: ``timeout_s`` plus
``GLOO_TIMEOUT_MARGIN_S`` from the post, so at most that margin after the
path's deadline that raised (ppsync.core.wire.completion.base).
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import threading
import time
from collections.abc import Callable

import anyio
import anyio.lowlevel
import torch.distributed as dist

from ppsync.core.path.token_path import TokenPath
from ppsync.core.wire.board import FailureBoard
from ppsync.core.wire.completion import Completion, HostCompleted
from ppsync.core.wire.completion.base import GLOO_TIMEOUT_MARGIN_S, POLL_FIRST_S, POLL_MAX_S
from ppsync.core.wire.transport import has_ended
from ppsync.core.wire.waits import Relayed, board_slices
from ppsync.errors import PPSyncError

EXIT_GRACE_S = GLOO_TIMEOUT_MARGIN_S + 1.0
"""Longest the exit hook waits for works that still carry a callback: a
silent peer's work ends at gloo's timeout, up to GLOO_TIMEOUT_MARGIN_S after
the deadline the survivor raised at, plus a second for the exit itself."""

INLINE_WAIT_S = 50e-6
"""Longest the loop thread waits inline (blocked) for a pending transfer
before handing the wait to the loop; once per :func:`await_work` call."""


def inline_wait(flag: threading.Event, bound_s: float) -> bool:
    """Wait on the loop thread, at most ``bound_s``, for ``flag`` (set by a
    work's done-callback on gloo's thread). A function of its own, so a test
    can count the calls and check their bounds."""
    return flag.wait(bound_s)

_with_callback: dict[int, dist.Work] = {}
"""id -> work given a done-callback that has not yet returned. A work's end
(``is_completed()``) comes before its callbacks run: the hook waits for the
callbacks themselves, since one that runs after the hook returned would run
while the interpreter finalizes."""


def _settle_at_exit(grace_s: float = EXIT_GRACE_S) -> None:
    """Wait (bounded, polling: the loop is gone) until every remembered
    work's callback has returned, so none runs while the interpreter
    finalizes."""
    deadline = time.monotonic() + grace_s
    while _with_callback and time.monotonic() < deadline:
        time.sleep(0.005)


def _remember(work: dist.Work) -> None:
    if not _with_callback:
        atexit.unregister(_settle_at_exit)  # registered once at a time
        atexit.register(_settle_at_exit)
    _with_callback[id(work)] = work


def _called_back(work: dist.Work) -> None:
    """``work``'s callback returns: nothing of it is left to run."""
    _with_callback.pop(id(work), None)


def _loop_waker(event: anyio.Event) -> Callable[[], None]:
    """A function any thread may call to set ``event`` on the current loop."""
    native = anyio.lowlevel.current_token().native_token
    # asyncio: the loop's call_soon_threadsafe; trio: TrioToken.run_sync_soon
    run_soon: Callable[[Callable[[], object]], object] = (
        native.call_soon_threadsafe
        if isinstance(native, asyncio.AbstractEventLoop)
        else getattr(native, "run_sync_soon")  # noqa: B009  (trio is optional)
    )

    def wake() -> None:
        with contextlib.suppress(RuntimeError):  # the loop has closed: nobody waits
            run_soon(event.set)

    return wake


_HOST = HostCompleted()


async def await_work(
    work: dist.Work,
    *,
    timeout_s: float,
    what: str,
    peer: int | None,
    board: FailureBoard | None = None,
    completion: Completion = _HOST,
) -> None:
    """Return once ``work`` has completed, without blocking the loop; raise
    SyncTimeout after ``timeout_s`` and PeerLost if the transfer failed or,
    with a ``board``, as soon as another rank posted a failure there.
    ``completion``: the group's semantics (default gloo's); on a
    stream-ordered group the future says nothing, so the work's end is polled
    (:func:`_polled`) and no stream is ordered.

    Cancellation leaves the work untouched (it still completes in the
    background and its owner keeps its buffer alive)."""
    if completion.stream_ordered:
        await _polled(work, completion, timeout_s=timeout_s, what=what, board=board)
    elif not has_ended(work):
        event = anyio.Event()
        if not _ended_inline(work, _loop_waker(event)):
            await _woken(event, timeout_s=timeout_s, what=what, board=board)
    # Ended: this returns at once, or raises the transfer's own error; it
    # never blocks the loop.
    completion.wait(work, timeout_s=timeout_s, what=what, peer=peer)


async def _polled(work: dist.Work, completion: Completion, *, timeout_s: float, what: str,
                  board: FailureBoard | None) -> None:
    """Sleep until ``completion`` says ``work`` ended (pauses doubling from
    POLL_FIRST_S to POLL_MAX_S: the loop runs other tasks meanwhile), under
    the deadline and the board's slices."""
    pause = POLL_FIRST_S
    for slice_s in board_slices(what, timeout_s=timeout_s, board=board, now=anyio.current_time):
        end = anyio.current_time() + slice_s
        while not completion.ended(work):
            if anyio.current_time() >= end:
                break
            await anyio.sleep(pause)
            pause = min(pause * 2, POLL_MAX_S)
        else:
            return


async def _woken(
    event: anyio.Event, *, timeout_s: float, what: str, board: FailureBoard | None
) -> None:
    """Await ``event`` (set by the work's callback through the loop) under
    the deadline, checking the board every slice (ppsync.core.wire.waits.board_slices)."""
    for slice_s in board_slices(what, timeout_s=timeout_s, board=board, now=anyio.current_time):
        with anyio.move_on_after(slice_s):
            await event.wait()
        if event.is_set():
            return


def _ended_inline(work: dist.Work, wake: Callable[[], None]) -> bool:
    """Give ``work`` its done-callback, then wait inline on the loop thread,
    at most ``INLINE_WAIT_S``, for it: True when the work ended meanwhile
    (nothing to await); on False the callback calls ``wake`` when it fires.

    The callback sets ``flag`` and calls ``wake`` unless the loop thread is
    still in the inline wait. The loop leaves that wait, clears ``inline``,
    then reads ``flag`` again: a callback that saw ``inline`` set (and did
    not wake the loop) has set ``flag`` before, so it is never missed."""
    flag = threading.Event()
    inline = [True]

    def on_done(_fut: object) -> None:
        try:
            flag.set()
            if not inline[0]:
                wake()
        finally:
            _called_back(work)

    _remember(work)
    work.get_future().add_done_callback(on_done)
    ended = inline_wait(flag, INLINE_WAIT_S)
    inline[0] = False
    return ended or flag.is_set()


async def await_path_work(path: TokenPath, work: dist.Work, what: str) -> None:
    """:func:`await_work` for one of ``path``'s transfers; a failure is posted
    on the path's board and re-raised naming the lost peers."""
    try:
        await await_work(
            work, timeout_s=path.config.timeout_s, what=f"rank {path.rank}: {what}",
            peer=None, board=path.board, completion=path.completion,
        )
    except PPSyncError as e:
        board = path.board
        if board is None:
            raise
        observed = not isinstance(e, Relayed)
        # post first, so the others can settle too
        path.failed(e, settle=False, observed=observed, dump=False)
        # give the survivors the board's grace to post: a bounded wait, failure path only
        deadline = anyio.current_time() + board.grace_s
        while len(board.missing()) > 1 and anyio.current_time() < deadline:  # noqa: ASYNC110 (a store, not an event)
            await anyio.sleep(0.05)
        named = path.failed(e, settle=False, observed=observed)
        if named is e:
            raise
        raise named from e
