"""A task that watches issued transfers complete, oldest first.

Both services hand every transfer they issue to a watcher. It keeps the
frame buffer referenced until the transfer completes, and turns a failed or
silent transfer into PeerLost / SyncTimeout in the rank's task group at once,
so a dead peer reaches the engine even while the engine is not calling ppsync.
Gloo completes one group's work in issue order, so waiting oldest first
costs at most one loop wake-up per step, and none when the transfer finished
before the watcher looked.
"""

from __future__ import annotations

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
    """Owns a bounded stream of issued transfers and the task draining it."""

    def __init__(self, path: TokenPath, *, capacity: int) -> None:
        send, recv = anyio.create_memory_object_stream[Issued](capacity)
        self._send: MemoryObjectSendStream[Issued] = send
        self._recv: MemoryObjectReceiveStream[Issued] = recv
        self.path = path
        self.completed = 0

    async def watch(self, item: Issued) -> None:
        """Queue ``item``; waits only when ``capacity`` transfers are still
        unconfirmed. If cancelled while waiting, the transfer itself is
        unaffected (it was issued before); only its watching is skipped."""
        await self._send.send(item)

    def close(self) -> None:
        """No more items: the run task ends after the queued ones."""
        self._send.close()

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Await each queued transfer's completion, oldest first."""
        async with self._recv:
            task_status.started()
            async for item in self._recv:
                await path_completed(self.path, item.work, f"transfer of frame {item.seq}")
                self.completed += 1
