"""The per-rank runtime: one token path and its service in one task group.

Engine loop (one task per rank, every rank in the same order)::

    async with open_rank(config, group) as rank:
        while serving:
            if not rank.is_last:
                released = await rank.take()   # step T-D, freed rows are -1
            for slot in freed_slots():
                rank.free(slot)
            batch = schedule()                 # identical on every rank
            if rank.is_last:
                await rank.publish(batch, SampledStep(tokens, num_sampled, num_rejected))
            else:
                await rank.post(batch)

Leaving the block normally drains: it waits (bounded) for every issued
transfer to complete, so no peer is left mid-collective. Leaving it by an
exception or cancellation abandons in-flight slots (their buffers stay
referenced by torch until gloo completes or fails them). A failure of a
transfer watched in the background (a dead or silent peer) cancels the body
and leaves the block as PeerLost or SyncTimeout itself, not wrapped in an
exception group.
"""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Literal, TypeVar

import anyio
import torch
import torch.distributed as dist

from ppsync.core.codec.released import ReleasedStep
from ppsync.core.frame.rows import SampledStep
from ppsync.core.path.names import CallNames
from ppsync.core.path.token_path import TokenPath
from ppsync.core.recorder.writer import dumps_pending
from ppsync.core.rules import BatchView
from ppsync.core.wire.board import FailureBoard
from ppsync.errors import PeerLost, PPSyncError, SyncTimeout
from ppsync.schemas.config import SyncConfig
from ppsync.services.awaiting import await_ended
from ppsync.services.endpoints import BroadcastService, ReceiveService

SERVICE_NAMES = CallNames(consume="take", post="post", publish="publish")

S = TypeVar("S", BroadcastService, ReceiveService)


class Rank:
    """What the engine holds inside ``open_rank``."""

    def __init__(self, path: TokenPath, service: BroadcastService | ReceiveService) -> None:
        self.path = path
        self.service = service

    @property
    def is_last(self) -> bool:
        return self.path.is_last

    @property
    def rank(self) -> int:
        return self.path.rank

    def free(self, req_idx: int) -> None:
        """Request slot ``req_idx`` was freed (finish, abort, preemption)."""
        self.path.free(req_idx)

    def dump(self, path: str | Path | None = None) -> Path:
        """Write this rank's flight record; see :meth:`TokenPath.dump`."""
        return self.path.dump(path)

    async def publish(self, view: BatchView, sampled: SampledStep) -> int:
        """Last rank: see :meth:`BroadcastService.publish`."""
        return await self._service_for("publish", BroadcastService).publish(view, sampled)

    async def post(self, view: BatchView) -> int:
        """Non-last ranks: see :meth:`ReceiveService.post`."""
        return await self._service_for("post", ReceiveService).post(view)

    async def take(self, draft_tokens_to_update: torch.Tensor | None = None) -> ReleasedStep | None:
        """Non-last ranks: see :meth:`ReceiveService.take`."""
        return await self._service_for("take", ReceiveService).take(draft_tokens_to_update)

    def _service_for(self, op: str, kind: type[S]) -> S:
        """The service, when ``op()`` belongs to this rank's role (RoleError
        otherwise, as the token path words it)."""
        self.path.require_role(op, last=kind is BroadcastService)
        assert isinstance(self.service, kind)  # the role decided the service
        return self.service


def _primary(eg: BaseExceptionGroup[BaseException]) -> BaseException | None:
    """The exception to raise instead of ``eg``: its one non-cancellation
    leaf; or, when every leaf is a PPSyncError (the watcher and the engine's
    call often see the same failure), the one naming a lost peer, else the
    first. None when ``eg`` mixes in other errors: then it is raised whole."""
    leaves: list[BaseException] = []
    stack: list[BaseException] = [eg]
    cancelled = anyio.get_cancelled_exc_class()
    while stack:
        e = stack.pop()
        if isinstance(e, BaseExceptionGroup):
            stack.extend(e.exceptions)
        elif not isinstance(e, cancelled):
            leaves.append(e)
    if len(leaves) == 1:
        return leaves[0]
    if not leaves or not all(isinstance(e, PPSyncError) for e in leaves):
        return None
    named = [e for e in leaves if isinstance(e, PeerLost) and e.peer is not None]
    return (named or leaves)[0]


@asynccontextmanager
async def open_rank(
    config: SyncConfig,
    group: dist.ProcessGroup,
    *,
    board: FailureBoard | Literal["group"] | None = "group",
    device: torch.device | str | None = None,
) -> AsyncIterator[Rank]:
    """Open this rank's token path over ``group`` (the dedicated token group)
    and run its service in a task group for the duration of the block.
    ``board``: see :class:`~ppsync.core.wire.board.FailureBoard`; ``device``:
    where the device codec's frames live (see :class:`TokenPath`)."""
    path = TokenPath(config, group, board=board, names=SERVICE_NAMES, wait_handshake=False,
                     device=device)
    path.dump_inline = False  # an error's dump is written off the loop's thread
    service: BroadcastService | ReceiveService = (
        BroadcastService(path) if path.is_last else ReceiveService(path)
    )
    try:
        # the peers may take seconds to arrive: await the handshake, never block on it
        work = path.handshake_work()
        assert work is not None  # wait_handshake=False: finish_handshake is due
        try:
            await await_ended(work, path.handshake_slices(),
                              what=f"rank {path.rank}: configuration handshake",
                              completion=path.completion)
        except SyncTimeout as e:
            raise path.handshake_error(e) from None
        path.finish_handshake()
    except BaseException:
        path.close(drain=False)
        raise
    try:
        async with anyio.create_task_group() as tg:
            await tg.start(service.run)
            try:
                yield Rank(path, service)
            finally:
                service.close()  # normal exit: run() drains what was issued
    except BaseExceptionGroup as eg:
        one = _primary(eg)
        if one is None:
            raise
        raise one from None
    finally:
        # leaving by an exception (the engine's, a cancellation, a failure):
        # peers waiting on this rank learn it from the board, naming it
        exc = sys.exc_info()[1]
        if exc is None:
            reason = None
        elif isinstance(exc, anyio.get_cancelled_exc_class()):
            reason = "its engine was cancelled"
        else:
            reason = f"its engine raised {type(exc).__name__}: {exc}"
        path.close(drain=False, reason=reason)
        if exc is not None and dumps_pending():
            # the dump an error's note names is on disk before the error leaves
            # (failure path only; bounded; the loop keeps running meanwhile)
            with anyio.CancelScope(shield=True), anyio.move_on_after(30):
                while dumps_pending():  # noqa: ASYNC110 (a thread's end, not an event)
                    await anyio.sleep(0.01)
