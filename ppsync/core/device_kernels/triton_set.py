"""The device kernels in Triton: one launch per step and role
(ppsync.core.device_kernels.triton_jit), no other device work.

What the codec around them still asks of torch per step (the staging copy
to the device, the verdict's copy to the host, a receiver's output tensors)
is the codec's (ppsync.core.frame.device_codec), the same for both sets.
"""

from __future__ import annotations

from typing import Literal

import torch
import triton

from ppsync.core.device_kernels import Outputs
from ppsync.core.device_kernels.triton_jit import check_release, pack_frame
from ppsync.core.frame.device_frames import (
    V_DRAFTS,
    V_FLAGGED,
    V_FRAME,
    V_NUM_REJECTED,
    V_NUM_SAMPLED,
    DeviceFrameCodec,
)
from ppsync.core.frame.layout import (
    FLAG_BAD_VALUES,
    FLAG_HAS_DRAFTS,
    HEADER_WORDS,
    Header,
    Staging,
)

# the kernels write these bits as literals
assert (V_NUM_SAMPLED, V_NUM_REJECTED, V_FRAME, V_FLAGGED, V_DRAFTS) == (1, 2, 4, 8, 16)
assert (int(Header.FLAGS), int(Header.CHECKSUM)) == (5, HEADER_WORDS - 1)

BLOCK_ROWS = 64
"""Rows per tile: a [64, BW] int64 tile per loop step."""


class TritonKernels:
    """The device codec's per-step work as one Triton launch per role."""

    name: Literal["torch", "triton"] = "triton"

    def __init__(self, frames: DeviceFrameCodec) -> None:
        lay = frames.layout
        self.frame_w = frames.frame_w
        self.L, self.K = lay.sample_width, lay.num_drafts
        self.staging = st = lay.staging
        br = min(BLOCK_ROWS, triton.next_power_of_2(max(lay.max_num_reqs, 1)))
        self._common = {"L": self.L, "K": self.K, "HW": HEADER_WORDS, "BOUNDS": Staging.bounds,
                        "FACTS": Staging.facts_at, "FLAG_BAD": FLAG_BAD_VALUES, "BR": br,
                        "BW": triton.next_power_of_2(lay.row_width)}
        self._release = {"IDX_OUT": st.idx_out, "KEPT_SLOTS": st.kept_slots,
                         "KEPT_ROWS": st.kept_rows, "FLAG_DRAFTS": FLAG_HAS_DRAFTS,
                         "BK": triton.next_power_of_2(max(self.K, 1))}
        # a pointer argument for a kernel's unused tensors (never read)
        self._none = torch.zeros(1, dtype=torch.int64, device=frames.device)
        self.pack_kernel = pack_frame
        self.release_kernel = check_release

    def pack(self, buf: torch.Tensor, stage: torch.Tensor, n: int, tokens: torch.Tensor,
             num_sampled: torch.Tensor, num_rejected: torch.Tensor,
             drafts: torch.Tensor | None, verdict: torch.Tensor) -> None:
        dr = self._none if drafts is None else drafts
        dr_s0, dr_s1 = (0, 0) if drafts is None else drafts.stride()
        self.pack_kernel[(1,)](
            buf, stage, self.frame_w, tokens, num_sampled, num_rejected, dr, verdict,
            n, tokens.shape[1], tokens.stride(0), tokens.stride(1), num_sampled.stride(0),
            num_rejected.stride(0), dr_s0, dr_s1, HAS_DRAFTS=drafts is not None,
            **self._common)

    def release(self, buf: torch.Tensor, stage: torch.Tensor, n: int,
                expect_drafts: bool | None, out: Outputs, table: torch.Tensor | None,
                kept: int, verdict: torch.Tensor) -> None:
        drafts = out.drafts
        use_table = table is not None and drafts is not None and kept > 0
        tab = table if use_table and table is not None else self._none
        tab_s0, tab_s1 = tab.stride() if use_table else (0, 0)
        self.release_kernel[(1,)](
            buf, stage, self.frame_w, out.tokens, out.counts, out.idx_mapping,
            self._none if drafts is None else drafts, tab, verdict,
            n, out.tokens.shape[1], kept, -1 if expect_drafts is None else int(expect_drafts),
            tab_s0, tab_s1, HAND_DRAFTS=drafts is not None, HAS_TABLE=use_table,
            **self._common, **self._release)
