"""Observing a transfer's completion from the event loop, by notification.

Gloo completes work on its own threads. Handing each wait to a worker thread
costs ~0.13 ms per step at P=2 and doubles the step at P=3 on 2 cores, and
polling starves gloo's threads (both seen on a 2-core machine). So: check ``is_completed()``
first (in the pipelined flow a slot's transfer has usually completed by the
time it is consumed, D steps later, and then nothing wakes at all); otherwise
register a done-callback on the work's future that hands ``Event.set`` to the
loop through its thread-safe entry point (asyncio's ``call_soon_threadsafe``,
trio's ``TrioToken.run_sync_soon``) and await the event under a deadline.

A torch future's ``add_done_callback`` runs the callback at once, in the
calling thread, when the future is already complete; the hand-off then simply
schedules ``set`` on this same loop, which is harmless.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

import anyio
import anyio.lowlevel
import torch.distributed as dist

from ppsync.core.handler import TokenPath
from ppsync.core.liveness import FailureBoard
from ppsync.core.transport import wait_work
from ppsync.errors import PeerLost, PPSyncError, SyncTimeout


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


async def completed(
    work: dist.Work,
    *,
    timeout_s: float,
    what: str,
    peer: int | None,
    board: FailureBoard | None = None,
) -> None:
    """Return once ``work`` has completed, without blocking the loop; raise
    SyncTimeout after ``timeout_s`` and PeerLost if the transfer failed or,
    with a ``board``, as soon as another rank posted a failure there.

    Cancellation leaves the work untouched (it still completes in the
    background and its owner keeps its buffer alive)."""
    if not work.is_completed():
        event = anyio.Event()
        wake = _loop_waker(event)
        work.get_future().add_done_callback(lambda _fut: wake())
        deadline = anyio.current_time() + timeout_s
        step = timeout_s if board is None else board.slice_s
        while not event.is_set():
            left = deadline - anyio.current_time()
            if left <= 0:
                raise SyncTimeout(f"{what}: no completion within timeout_s = {timeout_s}")
            with anyio.move_on_after(min(left, step)):
                await event.wait()
            if not event.is_set() and board is not None and board.anyone_failed():
                raise PeerLost(f"{what}: another rank reported a failure", peer=None)
    # Completed: this returns at once, or raises the transfer's own error.
    wait_work(work, timeout_s=timeout_s, what=what, peer=peer)


async def path_completed(path: TokenPath, work: dist.Work, what: str) -> None:
    """:func:`completed` for one of ``path``'s transfers; a failure is posted
    on the path's board and re-raised naming the lost peers."""
    try:
        await completed(
            work, timeout_s=path.config.timeout_s, what=f"rank {path.rank}: {what}",
            peer=None if path.is_last else path.src, board=path.board,
        )
    except PPSyncError as e:
        board = path.board
        if board is None:
            raise
        path.failed(e, settle=False)  # post first, so the others can settle too
        # give the survivors the board's grace to post: a bounded wait, failure path only
        deadline = anyio.current_time() + board.grace_s
        while len(board.missing()) > 1 and anyio.current_time() < deadline:  # noqa: ASYNC110 (a store, not an event)
            await anyio.sleep(0.05)
        named = path.failed(e, settle=False)
        if named is e:
            raise
        raise named from e
