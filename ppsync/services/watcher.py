"""Watching issued transfers complete, oldest first.

Both services hand every transfer they issue to a watcher. It turns a failed or
silent transfer into PeerLost / SyncTimeout, so a dead peer reaches the engine
even while the engine is not calling ppsync. (The token path itself keeps each
frame buffer until its transfer completed, then recycles it.)

Its waits have no time bound of their own (a healthy transfer may stay
pending for a pipeline's whole latency): a failure the rank's watcher
thread finds (ppsync.core.wire.rank_watch) ends them.

It costs no task switch and no loop wake-up while the engine is busy: gloo
completes one group's work in issue order, and in a pipelined engine a
transfer has usually completed by the time the next one is issued, so each
:meth:`Watcher.watch` settles the completed ones in the caller's task (a
failed one raises there). The watcher's own task sleeps until something is
pending, then looks once per ``idle_s``: only when no new transfer came in
that time (an idle engine) does it await the oldest one by notification.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import anyio
import torch.distributed as dist
from anyio.abc import TaskStatus

from ppsync.core.path.token_path import TokenPath
from ppsync.services.awaiting import await_path_work


@dataclass(frozen=True, slots=True)
class Issued:
    """One issued transfer."""

    seq: int
    work: dist.Work


class Watcher:
    """Transfers issued and not yet seen complete, and the task watching them."""

    def __init__(self, path: TokenPath, *, idle_s: float = 0.1) -> None:
        self.path = path
        self.idle_s = idle_s
        self._pending: deque[Issued] = deque()
        self._issued = 0  # transfers handed to watch() so far
        self._wake = anyio.Event()  # something became pending, or close()
        self._closed = False

    async def watch(self, item: Issued) -> None:
        """Add ``item`` and settle the completed ones in front (a failed
        transfer raises here). Never waits for an incomplete transfer."""
        self._pending.append(item)
        self._issued += 1
        while self._pending and self.path.completion.ended(self._pending[0].work):
            await self._done(self._pending.popleft())
        if self._pending and not self._wake.is_set():
            self._wake.set()

    def close(self) -> None:
        """No more items: :meth:`run` drains the pending ones, then returns."""
        self._closed = True
        self._wake.set()

    async def _done(self, item: Issued) -> None:
        """Returns at once for a completed transfer, or raises its error;
        awaits an incomplete one by notification, for as long as it takes
        (no engine call waits on it: only a failure the rank's watcher
        finds, a silent or lost peer, ends it)."""
        await await_path_work(self.path, item.work, f"transfer of frame {item.seq}",
                              bounded=False)

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Watch until :meth:`close`, then drain what was issued."""
        task_status.started()
        while not self._closed:
            if not self._pending:
                await self._wake.wait()
                self._wake = anyio.Event()
                continue
            front, issued = self._pending[0], self._issued
            await anyio.sleep(self.idle_s)
            if self._pending and self._pending[0] is front and self._issued == issued:
                await self._done(self._pending.popleft())  # idle engine: by notification
        while self._pending:
            await self._done(self._pending.popleft())
