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
before its callbacks run), and ppsync's exit hook
(ppsync.core.wire.teardown) waits, within its bound, until none is due
while the interpreter is still whole; past it (a receive from a peer that
is stopped, not dead, never ends) it ends the process at once.

Every wait here is sliced as the synchronous ones are
(ppsync.core.wire.waits.wait_slices): bounded from its own start, never
from a post, and ended at once by the path's failure, which the rank's
watcher thread finds (no store call on the loop's thread).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable, Generator, Sequence

import anyio
import anyio.lowlevel
import torch.distributed as dist

from ppsync.core.path.token_path import TokenPath
from ppsync.core.wire.board import Relayed
from ppsync.core.wire.completion import Completion, HostCompleted
from ppsync.core.wire.completion.semantics import POLL_FIRST_S, POLL_MAX_S
from ppsync.core.wire.teardown import exit_hazard
from ppsync.core.wire.transport import has_ended
from ppsync.core.wire.waits import WaitWatch, wait_slices
from ppsync.errors import PPSyncError

_HOST = HostCompleted()

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
(``is_completed()``) comes before its callbacks run: the exit waits for the
callbacks themselves, since one that runs after it would run while the
interpreter finalizes."""
exit_hazard(lambda: len(_with_callback))


def _remember(work: dist.Work) -> None:
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


async def await_work(work: dist.Work, *, timeout_s: float, what: str,
                     completion: Completion = _HOST, watch: WaitWatch | None = None,
                     peers: Sequence[int] = ()) -> None:
    """Return once ``work`` has ended, without blocking the loop; raise its
    own error, SyncTimeout ``timeout_s`` after the call (naming ``peers``),
    or the path's failure as soon as ``watch`` knows it: :func:`await_ended`
    with ppsync.core.wire.waits.wait_slices."""
    slices = wait_slices(what, timeout_s=timeout_s, watch=watch, peers=peers,
                         now=anyio.current_time)
    await await_ended(work, slices, what=what, completion=completion)


async def await_ended(work: dist.Work, slices: Generator[float, None, None], *, what: str,
                      completion: Completion) -> None:
    """Return once ``work`` has ended, without blocking the loop; raise its
    own error, or what ``slices`` raises (ppsync.core.wire.waits.wait_slices:
    the path's failure, the wait's bound). ``completion``: the group's
    semantics; on a stream-ordered group the future says nothing, so the
    work's end is polled (:func:`_polled`) and no stream is ordered.

    Cancellation leaves the work untouched (it still completes in the
    background and its owner keeps its buffer alive)."""
    with contextlib.closing(slices):  # a wait that ends says so at once (its watch)
        if completion.stream_ordered:
            await _polled(work, completion, slices)
        elif not has_ended(work):
            event = anyio.Event()
            if not _ended_inline(work, _loop_waker(event)):
                await _woken(event, slices)
    # Ended: this returns at once, or raises the transfer's own error; it
    # never blocks the loop.
    completion.wait(work, timeout_s=0.0, what=what, peer=None)


async def _polled(work: dist.Work, completion: Completion,
                  slices: Generator[float, None, None]) -> None:
    """Sleep until ``completion`` says ``work`` ended (pauses doubling from
    POLL_FIRST_S to POLL_MAX_S: the loop runs other tasks meanwhile)."""
    pause = POLL_FIRST_S
    for slice_s in slices:
        end = anyio.current_time() + slice_s
        while not completion.ended(work):
            if anyio.current_time() >= end:
                break
            await anyio.sleep(pause)
            pause = min(pause * 2, POLL_MAX_S)
        else:
            return


async def _woken(event: anyio.Event, slices: Generator[float, None, None]) -> None:
    """Await ``event`` (set by the work's callback through the loop) slice by slice."""
    for slice_s in slices:
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


async def await_path_work(path: TokenPath, work: dist.Work, what: str, *,
                          bounded: bool = True) -> None:
    """:func:`await_work` for one of ``path``'s transfers: a wait bounded by
    ``timeout_s`` from now (``bounded`` False: a transfer no engine call
    waits on, ended only by a failure); a failure is posted on the path's
    board and re-raised naming the lost peers."""
    watcher = path.watcher
    slices = wait_slices(f"rank {path.rank}: {what}",
                         timeout_s=path.config.timeout_s if bounded else None,
                         watch=watcher, peers=watcher.peers, now=anyio.current_time)
    try:
        await await_ended(work, slices, what=f"rank {path.rank}: {what}",
                          completion=path.completion)
    except PPSyncError as e:
        board = path.board
        if board is None or e is path.failures.final:
            named = path.failed(e, settle=False, observed=not isinstance(e, Relayed))
        else:
            observed = not isinstance(e, Relayed)
            path.failures.post(e, observed=observed)  # first, so the others can settle too
            # give the survivors the board's grace to post: a bounded wait, failure path only
            deadline = anyio.current_time() + board.grace_s
            while len(board.missing()) > 1 and anyio.current_time() < deadline:  # noqa: ASYNC110 (a store, not an event)
                await anyio.sleep(0.05)
            named = path.failed(e, settle=False, observed=observed)
        if named is e:
            raise
        raise named from e
