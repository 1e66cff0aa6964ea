"""BroadcastService (last rank) and ReceiveService (every other rank).

Each wraps one rank's :class:`~ppsync.core.path.token_path.TokenPath` for an anyio
event loop. Inputs are checked by the core before any collective; the
collective is issued at once from the caller's task (issuing a gloo async op
does not block), so the issue order is the engine's call order on every
rank. Each step's :class:`~ppsync.schemas.StepRecord` is kept as the values
the core checked and built (and validated) only when ``last_record`` is
read: a pydantic model per step would cost the hot path for nothing.
Nothing here blocks the loop: every wait goes through
:func:`ppsync.services.awaiting.await_work`.

One task per rank calls a service's methods, in the engine order of
``ppsync.core.path.token_path``.
"""

from __future__ import annotations

import anyio
import anyio.lowlevel
import torch
from anyio.abc import TaskStatus

from ppsync.core.codec.released import ReleasedStep
from ppsync.core.frame.rows import SampledStep
from ppsync.core.path.names import role_error
from ppsync.core.path.token_path import TokenPath
from ppsync.core.rules import BatchView
from ppsync.core.rules.checks import check_draft_target
from ppsync.schemas.records import StepRecord
from ppsync.services.awaiting import await_path_work
from ppsync.services.watcher import Issued, Watcher


class _Service:
    def __init__(self, path: TokenPath, *, last: bool) -> None:
        if path.is_last != last:
            raise role_error(type(self).__name__, rank=path.rank,
                             pp_size=path.config.pp_size, last=last)
        self.path = path
        self.watcher = Watcher(path)
        self._last: tuple[int, int, int, bool] | None = None  # see last_record

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """The service's task: watch issued transfers until :meth:`close`."""
        await self.watcher.run(task_status=task_status)

    def close(self) -> None:
        """Issue nothing more; :meth:`run` returns once issued transfers
        completed (or fails with their error)."""
        self.watcher.close()

    def _record(self, view: BatchView, needed: int, has_drafts: bool) -> None:
        """After the step's publish or post: its values (step 0-based)."""
        self._last = (self.path.last_step, int(view.num_reqs), needed, has_drafts)

    @property
    def last_record(self) -> StepRecord | None:
        """The last published or posted step's record, validated now; None
        before the first."""
        if self._last is None:
            return None
        step, num_reqs, needed, has_drafts = self._last
        c = self.path.config
        return StepRecord.model_validate({
            "step": step,
            "num_reqs": num_reqs,
            "num_needed": needed,
            "sample_width": c.sample_width,
            "num_drafts": c.num_speculative_steps,
            "has_drafts": has_drafts,
        })

    async def _before_issue(self) -> None:
        """Await (not block on) any work the core would otherwise wait on."""
        for work in self.path.works_before_issue():
            await await_path_work(self.path, work, "earlier transfer")

    async def _watch_last_issued(self) -> None:
        issued = self.path.last_issued()
        assert issued is not None  # the call just issued a transfer
        await self.watcher.watch(Issued(*issued))


class BroadcastService(_Service):
    """The last rank's side: validates each step and broadcasts its frame."""

    def __init__(self, path: TokenPath) -> None:
        super().__init__(path, last=True)

    async def publish(self, view: BatchView, sampled: SampledStep) -> int:
        """Broadcast one step (its batch view and sampled rows, as
        TokenPath.prepare takes them); return once its frame is issued.
        Returns the rows needing a sample (0: no transfer on any rank this
        step).

        Bad input raises before anything is issued. Cancelled before the
        issue: nothing was sent and the step can be published again.
        After the issue nothing awaits an incomplete transfer, so the call
        completes."""
        await anyio.lowlevel.checkpoint()  # a step without a wait still yields
        step, drafts = self.path.prepare(view, sampled)
        await self._before_issue()
        needed = self.path.send(step, drafts)
        self._record(step.view, needed, drafts is not None)
        if needed:
            await self._watch_last_issued()
        return needed


class ReceiveService(_Service):
    """A non-last rank's side: posts each step's receive and releases the
    step posted D steps ago (the consumer)."""

    def __init__(self, path: TokenPath) -> None:
        super().__init__(path, last=False)

    async def post(self, view: BatchView) -> int:
        """Post this step's receive; return once it is issued. Returns the
        rows needing a sample (0: no transfer this step). Bad input raises
        before anything is issued. Cancellation can only land at the call's
        first checkpoint, before anything changed: the step may be posted again."""
        await anyio.lowlevel.checkpoint()  # a step without a transfer still yields
        needed = self.path.post(view)
        self._record(view, needed, False)
        if needed:
            await self._watch_last_issued()
        return needed

    async def take(self, draft_tokens_to_update: torch.Tensor | None = None) -> ReleasedStep | None:
        """Release the step posted D steps ago, once its transfer completed.

        None for an empty slot or when every row is excluded (then it does not
        wait). Cancelled while waiting: nothing was consumed, the ring is as
        before, and take() may be called again."""
        await anyio.lowlevel.checkpoint()  # a completed or empty slot still yields
        c = self.path.config
        if draft_tokens_to_update is not None:
            check_draft_target(draft_tokens_to_update, max_num_reqs=c.max_num_reqs,
                               num_drafts=c.num_speculative_steps)
        await self._before_issue()
        work = self.path.work_before_consume()
        if work is not None:
            await await_path_work(self.path, work, "receive at the ring's head")
        return self.path.consume(draft_tokens_to_update)
