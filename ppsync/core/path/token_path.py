"""The synchronous token path of one rank: mask, ring, generations and frame
over one process group.

Per engine step, on every rank and in this order:

- receivers (every rank but the last): :meth:`TokenPath.consume` (releases
  the step posted D steps ago), :meth:`TokenPath.free` for freed request slots,
  then :meth:`TokenPath.post` with the new step's batch view; a step with an
  empty schedule (no batch) skips ``post``, on every rank alike, and its ring
  slot stays empty;
- the last rank: :meth:`TokenPath.free` for freed slots, then
  :meth:`TokenPath.publish` with the batch view and the sampler's outputs.

Every input is checked before any collective is issued, so a bad call on one
rank raises there and leaves the group usable. Every wait is bounded by
``config.timeout_s``. Each rule applied lives in its own module (mask, ring,
generations, checks, transport, the failure board, waits, failures,
recorder), and what depends on the codec in the codec object, chosen once:
no branch here asks which codec it has. What both roles share (the group,
its transfers, waits, failures and close) is the base class,
:class:`~ppsync.core.path.group_end.GroupEnd`.

The async contract (ppsync.services; trio's memory channels are the model:
a synchronous ``*_nowait`` core and a thin async wrapper): every call of a
token path is synchronous and waits only where its docstring says; an event
loop never lets it block, by awaiting first, by notification, the works it
would wait on, which these name:

- :meth:`TokenPath.handshake_work`: the start-up handshake's collective, to
  await before :meth:`TokenPath.finish_handshake` (with ``wait_handshake``
  False);
- :meth:`TokenPath.works_before_issue`: what the next send or consume would
  wait on (the oldest transfers beyond the ring's depth);
- :meth:`TokenPath.work_before_consume`: the receive the next consume waits on;
- :meth:`TokenPath.last_issued`: (seq, work) of the collective the last call
  issued, for a watcher to see complete; :attr:`TokenPath.last_step`: that
  call's 0-based step number.
"""
from __future__ import annotations

import time
from typing import Literal

import numpy as np
import torch
import torch.distributed as dist

from ppsync.core.codec import StepDrafts
from ppsync.core.codec.released import ReleasedStep
from ppsync.core.codec.steps import PendingStep, PreparedStep
from ppsync.core.frame.layout import FrameView
from ppsync.core.frame.rows import SampledStep
from ppsync.core.path.generations import GenerationTable
from ppsync.core.path.group_end import GroupEnd
from ppsync.core.path.names import TOKEN_PATH_NAMES, CallNames
from ppsync.core.recorder.on_error import records_errors
from ppsync.core.rules import BatchView
from ppsync.core.rules.checks import check_draft_target, check_sample_width
from ppsync.core.rules.facts import BatchFacts
from ppsync.core.wire.board import FailureBoard
from ppsync.core.wire.platform import Platform
from ppsync.errors import BatchError, ProtocolError
from ppsync.schemas.config import SyncConfig


class TokenPath(GroupEnd):
    """One rank's synchronous token path over ``group`` (the dedicated token
    group: same ranks as the PP group, last group rank samples)."""

    def __init__(
        self,
        config: SyncConfig,
        group: dist.ProcessGroup,
        *,
        board: FailureBoard | Literal["group"] | None = "group",
        names: CallNames = TOKEN_PATH_NAMES,
        wait_handshake: bool = True,
        device: torch.device | str | None = None,
        platform: str | Platform | None = None,
    ) -> None:
        """See :class:`~ppsync.core.path.group_end.GroupEnd` for every argument."""
        super().__init__(config, group, board=board, names=names,
                         wait_handshake=wait_handshake, device=device, platform=platform)
        self.generations = GenerationTable(config.max_num_reqs)
        self._tail_open = False  # receivers: consume() reserved a tail not yet posted

    # -- the async contract (see the module docstring), past GroupEnd's ----

    def work_before_consume(self) -> dist.Work | None:
        """The work the next :meth:`consume` will wait on, or None when it will
        not wait (an empty slot, or every row excluded)."""
        if self.is_last or self._closed:
            return None
        head = self.ring.head()
        if head is None or self._keep(head)[1] == 0:
            return None
        return head.work

    @property
    def last_step(self) -> int:
        """The 0-based number of the last post/publish call; -1 before one."""
        return self.steps - 1

    # -- last rank --------------------------------------------------------

    @records_errors
    def prepare(
        self, view: BatchView, sampled: SampledStep,
    ) -> tuple[PreparedStep, StepDrafts | None]:
        """Check one step's batch view and its sampled rows (last rank):
        tokens, counts, the (optional) drafts and the step's width; nothing
        is sent. Returns the prepared step and its drafts as the codec keeps
        them (host codec: a host array; device codec: the tensor).

        Device codec: dtypes, shapes and the batch view are checked here; the
        values of num_sampled / num_rejected are checked on the device, and a
        bad one raises BatchError at the next call (see
        ppsync.core.codec.device)."""
        self.require_role(self.names.publish, last=True)
        self.codec.settle()  # a sent step's deferred verdict (device codec)
        if not isinstance(sampled, SampledStep):
            raise BatchError(f"sampled must be a SampledStep, got {type(sampled).__name__}")
        check_sample_width(sampled.sample_width, self.config.sample_width)
        facts = self._batch_facts(view)
        return self.codec.prepare(view, facts, sampled)

    @records_errors
    def send(self, step: PreparedStep, drafts: StepDrafts | None = None) -> int:
        """Broadcast a prepared step (``drafts``: [num_reqs, K] as prepare
        returned them, or None). Returns the rows needing a sample; 0 means
        the step had no transfer."""
        self.require_role(self.names.publish, last=True)
        if not isinstance(step, PreparedStep):
            raise BatchError(f"step must be a PreparedStep from prepare(), got "
                             f"{type(step).__name__}")
        self.codec.settle()
        if drafts is not None:
            drafts = self.codec.check_drafts(drafts, step.view.num_reqs)
        self.steps += 1
        facts = step.facts
        needed = facts.needed
        if needed == 0:
            self.recorder.call(True, self.steps - 1, 0, step.view.num_reqs)
            return 0
        self._prune()
        frame = self._frame_view(facts, step.sample_width)
        buf, work, flags, checksum = self.codec.send(frame, step, drafts, self._issue)
        self.recorder.issue(work, self.steps - 1, self.seq, 0, frame.num_reqs, needed,
                            frame.idx_digest, checksum, flags)
        self._inflight.add(buf, work)
        self._issued(work)
        return needed

    def publish(self, view: BatchView, sampled: SampledStep) -> int:
        """Check and broadcast one step (last rank): :meth:`prepare` then
        :meth:`send`. Returns the rows needing a sample; 0 means the step had
        no transfer on any rank."""
        return self.send(*self.prepare(view, sampled))

    # -- receivers --------------------------------------------------------

    @records_errors
    def post(
        self, view: BatchView, *, expect_drafts: bool | None = None,
        sample_width: int | None = None,
    ) -> int:
        """Post this step's receive into the ring's tail (non-last ranks).
        Returns the rows needing a sample; 0 means no transfer this step.
        ``expect_drafts``: whether the frame must carry drafts (a frame that
        disagrees is a DesyncError at consume); ``sample_width``: the step's
        width w (1..L), checked against the header and the width released."""
        self.require_role(self.names.post, last=False)
        check_sample_width(sample_width, self.config.sample_width)
        if expect_drafts is not None and not isinstance(expect_drafts, bool):
            raise BatchError(f"expect_drafts = {expect_drafts!r} must be a bool or None")
        if not self._tail_open:
            c, p = self.names.consume, self.names.post
            raise ProtocolError(
                f"rank {self.rank}: {p}() without a {c}() before it; each step is "
                f"{c}() then {p}()"
            )
        # the facts are copies: the engine may refill its batch arrays before
        # this step is consumed
        facts = self._batch_facts(view)
        needed = facts.needed
        self._tail_open = False
        self.steps += 1
        if needed == 0:
            self.recorder.call(False, self.steps - 1, self.ring.advanced, view.num_reqs)
            return 0
        frame = self._frame_view(facts, sample_width)
        buf, staging, work = self.codec.post(frame, self._issue)
        self.recorder.issue(work, self.steps - 1, self.seq, self.ring.advanced, frame.num_reqs,
                            needed, frame.idx_digest, 0, 0)
        self.ring.fill_tail(PendingStep(frame, facts.need, needed, facts.idx,
                                        self.generations.mark(), buf, work, expect_drafts,
                                        staging))
        self._issued(work)
        return needed

    @records_errors
    def consume(self, draft_tokens_to_update: torch.Tensor | None = None) -> ReleasedStep | None:
        """Release the step posted D steps ago (non-last ranks).

        Returns None for an empty slot, or when every row is excluded (then it
        does not wait). Otherwise waits, at most timeout_s, for the transfer,
        checks the header against this rank's view (DesyncError), and scatters
        drafts into ``draft_tokens_to_update[slot]`` for kept rows only."""
        self.require_role(self.names.consume, last=False)
        # consume() again without a post() between: the step before had an empty
        # schedule, so its reserved tail stays an empty slot (no transfer on any
        # rank; a rank that posted where others did not is caught by the frame's
        # seq and digest).
        table = None
        if draft_tokens_to_update is not None:
            table = check_draft_target(
                draft_tokens_to_update,
                max_num_reqs=self.config.max_num_reqs,
                num_drafts=self.config.num_speculative_steps,
            )
        self._prune()
        # an earlier step's deferred verdict (device codec): raised before the
        # ring moves, so this consume can be retried
        self._checked(self.codec.settle)
        head = self.ring.advance()
        self._tail_open = True
        if head is None:
            return None
        keep, kept = self._keep(head)
        if kept == 0:
            # Nothing to hand out: do not wait, but keep the buffer alive and
            # the work watched until it completes.
            self._inflight.add(head.buf, head.work)
            self.codec.skip(head)
            self.recorder.consume(head.frame, self.steps, self.ring.advanced, None, 0, 0)
            return None
        wait_from_ns = time.monotonic_ns()
        released = self._checked(self.codec.release, head, keep, kept, table,
                                 self._waits.for_receive, self.rank)
        self.recorder.consume(head.frame, self.steps, self.ring.advanced, keep, kept,
                              wait_from_ns)
        return released

    @records_errors
    def free(self, req_idx: int) -> None:
        """Request slot ``req_idx`` was freed (finish, abort, preemption)."""
        self._check_open()
        self.generations.bump(req_idx)
        self.recorder.free(self.steps, req_idx, self.generations.generation(req_idx))

    # -- what the roles' calls share --------------------------------------

    def _batch_facts(self, view: BatchView) -> BatchFacts:
        """The batch's checked facts, need mask and digest, as copies."""
        return self.codec.kernels.facts(view)

    def _frame_view(self, facts: BatchFacts, sample_width: int | None) -> FrameView:
        """This rank's view of the frame it issues next."""
        return FrameView(self.seq, facts.need.shape[0], facts.digest, facts.slot_need,
                         facts.computed, sample_width, facts.row_facts)

    def _keep(self, head: PendingStep) -> tuple[np.ndarray, int]:
        """([num_reqs] bool, their count): rows that needed a sample and whose
        slot was not freed since the receive was posted (the usual step, with
        no slot freed since: the need mask itself)."""
        unchanged = self.generations.unchanged_since(head.idx_np, head.freed_mark)
        if unchanged is None:
            return head.need_np, head.needed
        keep: np.ndarray = head.need_np & unchanged
        return keep, int(np.count_nonzero(keep))

