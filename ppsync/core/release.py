"""What a consume hands out from a received host frame (the host codec):
the step's rows as a ReleasedStep, excluded rows at -1, and the drafts of
kept rows scattered into the engine's draft table (rule 4)."""

from __future__ import annotations

import numpy as np
import torch

from ppsync.core.frame import FrameCodec, drafts_desync
from ppsync.core.released import ReleasedStep
from ppsync.core.steps import PendingStep
from ppsync.schemas.records import FLAG_HAS_DRAFTS


def release_host(codec: FrameCodec, head: PendingStep, keep: np.ndarray, kept: int,
                 table: torch.Tensor | None, *, rank: int) -> ReleasedStep:
    """Check ``head``'s received frame against this rank's view (DesyncError)
    and read it out; ``kept``: how many rows ``keep`` holds. Everything handed
    out is the caller's own: copies of the frame buffer (recycled once this
    returns) and the posted step's own idx copy."""
    buf_np = head.buf.numpy()
    flags = codec.check(buf_np, head.frame, rank=rank)
    has_drafts = bool(flags & FLAG_HAS_DRAFTS)
    if head.expect_drafts is not None and head.expect_drafts != has_drafts:
        raise drafts_desync(rank, head.frame.seq, head.expect_drafts, has_drafts,
                            codec.header_dict(buf_np))
    L = codec.sample_width
    w = head.frame.width(codec)
    n = head.frame.num_reqs
    rows = codec.rows(buf_np, n)
    # every row kept (the usual step): the posted step's idx copy, which
    # nothing else holds once the step is released, is handed out as it is
    idx_out = head.idx_np if kept == n else np.where(keep, head.idx_np, -1)
    drafts = None
    if has_drafts:
        drafts_np = codec.drafts(rows).copy()
        drafts = torch.from_numpy(drafts_np)
        if table is not None:
            if kept == n:
                scatter_rows(table, head.idx_np, drafts_np)
            else:
                scatter_rows(table, head.idx_np[keep], drafts_np[keep])
    # both counts in one call: [2, num_reqs] int32, each row contiguous
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
