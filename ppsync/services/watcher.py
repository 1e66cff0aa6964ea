"""A task that watches issued transfers complete, oldest first.

Both services hand every transfer they issue to a watcher. It keeps the frame
buffer referenced until the transfer completes, and turns a failed or silent
transfer into PeerLost / SyncTimeout in the rank's task group, so a dead peer
reaches the engine even while the engine is not calling ppsync.

It costs no loop wake-up while the engine is busy: gloo completes one group's
work in issue order, and in a pipelined engine a transfer has usually
completed by the time the next one is issued, so the watcher simply checks
``is_completed()`` whenever a new transfer arrives. Only when no new transfer
comes for ``idle_s`` (an idle engine) does it await the oldest one by
notification.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import anyio
import torch
import torch.distributed as dist
from anyio.abc import TaskStatus
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from ppsync.core.handler import TokenPath
from ppsync.services.completion import path_completed


@dataclass(frozen=True, slots=True)
class Issued:
    """One issued transfer and the buffer it reads or fills."""

    seq: int
    buf: torch.Tensor  # [words] int64 frame buffer
    work: dist.Work


class Watcher:
    """Owns a stream of issued transfers and the task that watches them."""

    def __init__(self, path: TokenPath, *, capacity: int, idle_s: float = 0.1) -> None:
        send, recv = anyio.create_memory_object_stream[Issued](capacity)
        self._send: MemoryObjectSendStream[Issued] = send
        self._recv: MemoryObjectReceiveStream[Issued] = recv
        self.path = path
        self.idle_s = idle_s
        self.completed = 0

    async def watch(self, item: Issued) -> None:
        """Queue ``item``. If cancelled while waiting, the transfer itself is
        unaffected (it was issued before); only its watching is skipped."""
        await self._send.send(item)

    def close(self) -> None:
        """No more items: the run task ends once the queued ones completed."""
        self._send.close()

    async def _done(self, item: Issued) -> None:
        """Returns at once for a completed transfer, or raises its error."""
        await path_completed(self.path, item.work, f"transfer of frame {item.seq}")
        self.completed += 1

    async def _settle(self, pending: deque[Issued]) -> None:
        """Drop completed transfers from the front, raising a failed one's error."""
        while pending and pending[0].work.is_completed():
            await self._done(pending.popleft())

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Watch queued transfers until :meth:`close`, then drain them."""
        pending: deque[Issued] = deque()
        async with self._recv:
            task_status.started()
            while True:
                await self._settle(pending)
                try:
                    if not pending:
                        pending.append(await self._recv.receive())
                        continue
                    with anyio.move_on_after(self.idle_s):
                        pending.append(await self._recv.receive())
                        continue
                except anyio.EndOfStream:
                    break
                # idle engine: await the oldest transfer by notification
                await self._done(pending.popleft())
        for item in pending:  # closed: drain what was issued
            await self._done(item)
