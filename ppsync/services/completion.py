"""Observing a transfer's completion from the event loop, by notification.

Gloo completes work on its own threads. Handing each wait to a worker thread
costs ~0.13 ms per step at P=2 and doubles the step at P=3 on 2 cores, and
polling starves gloo's threads (MEASURED.md). So: check ``is_completed()``
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

from ppsync.core.transport import wait_work
from ppsync.errors import SyncTimeout


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


async def completed(work: dist.Work, *, timeout_s: float, what: str, peer: int | None) -> None:
    """Return once ``work`` has completed, without blocking the loop; raise
    SyncTimeout after ``timeout_s`` and PeerLost if the transfer failed.

    Cancellation leaves the work untouched (it still completes in the
    background and its owner keeps its buffer alive)."""
    if not work.is_completed():
        event = anyio.Event()
        wake = _loop_waker(event)
        work.get_future().add_done_callback(lambda _fut: wake())
        try:
            with anyio.fail_after(timeout_s):
                await event.wait()
        except TimeoutError:
            raise SyncTimeout(
                f"{what}: no completion within timeout_s = {timeout_s}"
            ) from None
    # Completed: this returns at once, or raises the transfer's own error.
    wait_work(work, timeout_s=timeout_s, what=what, peer=peer)
