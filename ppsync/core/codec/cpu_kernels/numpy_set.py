"""The reference CPU kernels: the host codec's per-step work in numpy.

Every rule and every error message of the host path lives in the functions
these call (ppsync.core.rules, ppsync.core.rules.checks, the NumpyFrames); a faster
kernel set (ppsync.core.codec.cpu_kernels.numba_set) must give the same results
and, for bad input, run these to raise the same errors.
"""

from __future__ import annotations

import numpy as np
import torch

from ppsync.core.codec.released import ReleasedStep
from ppsync.core.codec.steps import PendingStep
from ppsync.core.frame.layout import FLAG_HAS_DRAFTS, FrameView
from ppsync.core.frame.numpy_frames import NumpyFrames, drafts_desync
from ppsync.core.frame.rows import SampledStep
from ppsync.core.rules import BatchView
from ppsync.core.rules.checks import check_sampled
from ppsync.core.rules.facts import BatchFacts, batch_facts


class NumpyKernels:
    """The host codec's per-step work for one configuration's frames."""

    name = "numpy"

    def __init__(self, frames: NumpyFrames) -> None:
        self.frames = frames

    def facts(self, view: BatchView) -> BatchFacts:
        """Check ``view`` and derive its facts, need mask and digest (both roles)."""
        facts = batch_facts(view, self.frames.max_num_reqs)
        if facts.needed:
            facts.digest = self.frames.facts_digest(facts.row_facts)
        return facts

    def sampled(self, sampled: SampledStep, *, num_reqs: int) -> SampledStep[np.ndarray]:
        """Check one step's sampled rows but its drafts (last rank); the
        record of their host arrays."""
        f = self.frames
        tokens_np, ns_np, nr_np = check_sampled(
            sampled.tokens, sampled.num_sampled, sampled.num_rejected, num_reqs=num_reqs,
            sample_width=f.sample_width, num_drafts=f.num_drafts,
            step_width=sampled.sample_width)
        return SampledStep(tokens_np, ns_np, nr_np, None, sampled.sample_width)

    def pack(self, buf_np: np.ndarray, frame: FrameView, rows: SampledStep[np.ndarray]
             ) -> tuple[int, int]:
        """Write one checked step's rows into ``buf_np``; (flags, checksum)."""
        return self.frames.pack(buf_np, frame, rows.tokens, rows.num_sampled,
                                rows.num_rejected, rows.drafts)

    def release(self, head: PendingStep, keep: np.ndarray, kept: int,
                table: torch.Tensor | None, rank: int) -> ReleasedStep:
        """Check ``head``'s received frame against this rank's view
        (DesyncError) and read out its rows: copies, and the posted step's
        own idx copy; kept rows' drafts scattered into ``table``."""
        frames = self.frames
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
        cols = frames.columns
        counts = np.array(rows[:, cols.counts].T, dtype=np.int32, order="C")
        tok = cols.tokens.offset
        return ReleasedStep(
            seq=head.frame.seq,
            sampled_tokens=torch.from_numpy(rows[:, tok : tok + w].copy()),
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
