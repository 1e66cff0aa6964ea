"""The host codec: frames packed and checked in numpy on the host.

Every value of a step is checked before its frame is sent (a bad one raises
at that call, before any collective). A consume copies what it hands out of
the received frame: the step's rows as a ReleasedStep, excluded rows at -1,
and the drafts of kept rows scattered into the engine's draft table (rule 4).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from ppsync.core.batch import BatchView
from ppsync.core.batch.facts import BatchFacts
from ppsync.core.checks import (
    check_drafts_array,
    check_sampled,
    check_step_drafts,
    check_width_fits,
)
from ppsync.core.frame.codec import Issue, StepDrafts, Wait
from ppsync.core.frame.host_frames import FrameCodec, drafts_desync
from ppsync.core.frame.layout import FLAG_HAS_DRAFTS, BufferPool, FrameView
from ppsync.core.released import ReleasedStep
from ppsync.core.steps import PendingStep, PreparedStep
from ppsync.errors import BatchError
from ppsync.schemas.config import SyncConfig


class HostCodec:
    """The host codec's share of a token path (see ppsync.core.frame.codec)."""

    on_device = False

    def __init__(self, config: SyncConfig) -> None:
        self.frames = FrameCodec(config)
        self.device = torch.device("cpu")
        self.buffers = BufferPool(self.frames)

    def settle(self, all_: bool = False) -> None:
        """Nothing is deferred: every value was checked before its send."""

    # -- last rank --------------------------------------------------------

    def prepare(
        self, view: BatchView, facts: BatchFacts, sampled_token_ids: object,
        num_sampled: object, num_rejected: object, draft_tokens: object | None,
        sample_width: int | None,
    ) -> tuple[PreparedStep, np.ndarray | None]:
        f = self.frames
        tokens_np, ns_np, nr_np = check_sampled(
            sampled_token_ids, num_sampled, num_rejected,
            num_reqs=view.num_reqs, sample_width=f.sample_width, num_drafts=f.num_drafts,
            step_width=sample_width,
        )
        drafts_np = None if draft_tokens is None else check_step_drafts(
            draft_tokens, num_reqs=view.num_reqs, num_drafts=f.num_drafts)
        check_width_fits(tokens_np.shape[1], sample_width)
        return PreparedStep(view, facts, tokens_np, ns_np, nr_np, sample_width), drafts_np

    def check_drafts(self, drafts: object, num_reqs: int) -> StepDrafts:
        check_drafts_array(drafts, num_reqs=num_reqs, num_drafts=self.frames.num_drafts)
        assert isinstance(drafts, np.ndarray)  # checked just above
        return drafts

    def send(self, frame: FrameView, step: PreparedStep, drafts: StepDrafts | None,
             issue: Issue) -> tuple[torch.Tensor, dist.Work, int, int]:
        if step.tokens_np is None or step.num_sampled_np is None or (
                step.num_rejected_np is None):
            raise BatchError("step was prepared for the device codec; this path uses "
                             "the host codec")
        assert not isinstance(drafts, torch.Tensor)  # check_drafts returned a host array
        buf = self.buffers.take(frame.num_reqs)
        flags, checksum = self.frames.pack(buf.numpy(), frame, step.tokens_np,
                                           step.num_sampled_np, step.num_rejected_np, drafts)
        return buf, issue(buf), flags, checksum

    # -- receivers --------------------------------------------------------

    def post(self, frame: FrameView, issue: Issue
             ) -> tuple[torch.Tensor, torch.Tensor | None, dist.Work]:
        buf = self.buffers.take(frame.num_reqs)
        return buf, None, issue(buf)

    def release(self, head: PendingStep, keep: np.ndarray, kept: int,
                table: torch.Tensor | None, wait: Wait, rank: int) -> ReleasedStep:
        """Check ``head``'s received frame against this rank's view
        (DesyncError) and read it out. Everything handed out is the caller's
        own: copies of the frame buffer (recycled once this returns) and the
        posted step's own idx copy."""
        wait(head.work, head.frame.seq)
        released = _read_out(self.frames, head, keep, kept, table, rank=rank)
        self.buffers.give(head.buf)  # everything released was copied out
        return released

    def skip(self, head: PendingStep) -> None:
        """Nothing to give back: the buffer returns once its transfer completed."""

    def reuse(self, buf: torch.Tensor) -> None:
        self.buffers.give(buf)


def _read_out(frames: FrameCodec, head: PendingStep, keep: np.ndarray, kept: int,
              table: torch.Tensor | None, *, rank: int) -> ReleasedStep:
    buf_np = head.buf.numpy()
    flags = frames.check(buf_np, head.frame, rank=rank)
    has_drafts = bool(flags & FLAG_HAS_DRAFTS)
    if head.expect_drafts is not None and head.expect_drafts != has_drafts:
        raise drafts_desync(rank, head.frame.seq, head.expect_drafts, has_drafts,
                            frames.header_dict(buf_np))
    w = head.frame.width(frames)
    n = head.frame.num_reqs
    rows = frames.rows(buf_np, n)
    # every row kept (the usual step): the posted step's idx copy, which
    # nothing else holds once the step is released, is handed out as it is
    idx_out = head.idx_np if kept == n else np.where(keep, head.idx_np, -1)
    drafts = None
    if has_drafts:
        drafts_np = frames.drafts(rows).copy()
        drafts = torch.from_numpy(drafts_np)
        if table is not None:
            if kept == n:
                scatter_rows(table, head.idx_np, drafts_np)
            else:
                scatter_rows(table, head.idx_np[keep], drafts_np[keep])
    # both counts in one call: [2, num_reqs] int32, each row contiguous
    L = frames.col_num_sampled
    counts = np.array(rows[:, L:L + 2].T, dtype=np.int32, order="C")
    return ReleasedStep(
        seq=head.frame.seq,
        sampled_tokens=torch.from_numpy(rows[:, :w].copy()),
        num_sampled=torch.from_numpy(counts[0]),
        num_rejected=torch.from_numpy(counts[1]),
        idx_mapping=torch.from_numpy(idx_out),
        draft_tokens=drafts,
        kept_np=keep,
    )


def scatter_rows(table: torch.Tensor, idx_np: np.ndarray, rows_np: np.ndarray) -> None:
    """table[idx] = rows, for kept rows only (rule 4: never a -1 index)."""
    if table.device.type == "cpu":
        table.numpy()[idx_np] = rows_np
    else:
        idx = torch.from_numpy(idx_np).to(table.device, non_blocking=True)
        table[idx] = torch.from_numpy(rows_np).to(table.device, table.dtype, non_blocking=True)
