"""The device kernels in Triton: one launch per step and role
(ppsync.core.codec.device_kernels.triton_jit), no other device work.

What the codec around them still asks of torch per step (the staging copy
to the device, the verdict's copy to the host, a receiver's output tensors)
is the codec's (ppsync.core.codec.device), the same for both sets.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Literal

import torch
import triton

from ppsync.core.codec.device_kernels.contract import TRITON_DEVICES, Outputs, interpreting
from ppsync.core.codec.device_kernels.triton_jit import check_release, pack_frame
from ppsync.core.frame.device_frames import (
    V_DRAFTS,
    V_FLAGGED,
    V_FRAME,
    V_NUM_REJECTED,
    V_NUM_SAMPLED,
    DeviceFrames,
)
from ppsync.core.frame.layout import (
    FLAG_BAD_VALUES,
    FLAG_HAS_DRAFTS,
    HEADER_WORDS,
    Header,
    Staging,
)
from ppsync.core.frame.rows import SampledStep

# the kernels write these bits as literals
assert (V_NUM_SAMPLED, V_NUM_REJECTED, V_FRAME, V_FLAGGED, V_DRAFTS) == (1, 2, 4, 8, 16)
assert (int(Header.FLAGS), int(Header.CHECKSUM)) == (5, HEADER_WORDS - 1)

BLOCK_ROWS = 64
"""Rows per tile: a [64, BW] int64 tile per loop step."""


Launch = tuple[tuple[object, ...], dict[str, object]]
"""A kernel's arguments: (positional, keyword)."""

INT_DTYPES = (torch.int32, torch.int64)
"""The dtypes a caller's integer tensors may have (ppsync.core.rules.checks): the
sampler's num_sampled / num_rejected, drafts and the draft table."""


class TritonKernels:
    """The device codec's per-step work as one Triton launch per role.

    Every variant the codec can launch is compiled when the set is built
    (:meth:`warm_up`; not in Triton's interpreter): the kernels specialize
    on nothing per step (triton_jit.PACK_RUNTIME, RELEASE_RUNTIME), so a
    variant is a flag combination (:meth:`combinations`)."""

    name: Literal["torch", "triton"] = "triton"

    def __init__(self, frames: DeviceFrames) -> None:
        lay = frames.layout
        self.device = frames.device
        self.frame_w = frames.frame_w
        self.L, self.K = lay.sample_width, lay.num_drafts
        self.staging = st = lay.staging
        br = min(BLOCK_ROWS, triton.next_power_of_2(max(lay.max_num_reqs, 1)))
        cols = lay.columns
        self._common = {"TOK": cols.tokens.offset, "L": cols.tokens.width,
                        "NS": cols.num_sampled.offset, "NR": cols.num_rejected.offset,
                        "DR": cols.drafts.offset, "K": cols.drafts.width,
                        "SN": cols.slot_need.offset, "NC": cols.num_computed.offset,
                        "W": cols.row_width, "HW": HEADER_WORDS, "BOUNDS": Staging.bounds,
                        "FACTS": Staging.facts_at, "FLAG_BAD": FLAG_BAD_VALUES, "BR": br,
                        "BW": triton.next_power_of_2(lay.row_width)}
        self._release = {"IDX_OUT": st.idx_out, "KEPT_SLOTS": st.kept_slots,
                         "KEPT_ROWS": st.kept_rows, "FLAG_DRAFTS": FLAG_HAS_DRAFTS,
                         "BK": triton.next_power_of_2(max(self.K, 1))}
        # a pointer argument for a kernel's unused tensors (never read)
        self._none = torch.zeros(1, dtype=torch.int64, device=frames.device)
        self.pack_kernel = pack_frame
        self.release_kernel = check_release
        if frames.device.type in TRITON_DEVICES and not interpreting():
            self.warm_up()

    def combinations(self) -> tuple[list[tuple[torch.dtype, torch.dtype, torch.dtype | None]],
                                    list[tuple[bool, torch.dtype | None]]]:
        """Every flag combination the codec can launch, as (pack: num_sampled's,
        num_rejected's and the drafts' dtypes, None: no drafts), (release:
        drafts handed out, the draft table's dtype, None: no table)."""
        drafts: list[torch.dtype | None] = [None, *(INT_DTYPES if self.K else ())]
        packs = [(ns, nr, d) for ns in INT_DTYPES for nr in INT_DTYPES for d in drafts]
        releases: list[tuple[bool, torch.dtype | None]] = [(False, None)]
        if self.K:
            releases += [(True, None), *((True, t) for t in INT_DTYPES)]
        return packs, releases

    def warm_up(self) -> int:
        """Compile every variant (:meth:`combinations`) for the current
        device of ``self.device``'s type, without launching; returns how many."""
        packs, releases = self.combinations()
        def one(dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(1, dtype=dtype, device=self.device)

        i64 = one(torch.int64)
        tokens = torch.zeros((1, self.L), dtype=torch.int64, device=self.device)
        with _on(self.device):
            for ns, nr, d in packs:
                args, kw = self._pack_call(i64, i64, 1, tokens, one(ns), one(nr),
                                           None if d is None else one(d).view(1, 1), i64)
                self.pack_kernel.warmup(*args, grid=(1,), **kw)
            for hand, table in releases:
                out = Outputs(tokens, torch.zeros((2, 1), dtype=torch.int32, device=self.device),
                              i64, tokens if hand else None)
                args, kw = self._release_call(i64, i64, 1, None, out,
                                              None if table is None else one(table).view(1, 1),
                                              1, i64)
                self.release_kernel.warmup(*args, grid=(1,), **kw)
        return len(packs) + len(releases)

    def _pack_call(self, buf: torch.Tensor, stage: torch.Tensor, n: int, tokens: torch.Tensor,
                   num_sampled: torch.Tensor, num_rejected: torch.Tensor,
                   drafts: torch.Tensor | None, verdict: torch.Tensor) -> Launch:
        dr = self._none if drafts is None else drafts
        dr_s0, dr_s1 = (0, 0) if drafts is None else drafts.stride()
        return ((buf, stage, self.frame_w, tokens, num_sampled, num_rejected, dr, verdict,
                 n, tokens.shape[1], tokens.stride(0), tokens.stride(1), num_sampled.stride(0),
                 num_rejected.stride(0), dr_s0, dr_s1),
                {"HAS_DRAFTS": drafts is not None, **self._common})

    def _release_call(self, buf: torch.Tensor, stage: torch.Tensor, n: int,
                      expect_drafts: bool | None, out: Outputs, table: torch.Tensor | None,
                      kept: int, verdict: torch.Tensor) -> Launch:
        drafts = out.drafts
        use_table = table is not None and drafts is not None and kept > 0
        tab = table if use_table and table is not None else self._none
        tab_s0, tab_s1 = tab.stride() if use_table else (0, 0)
        return ((buf, stage, self.frame_w, out.tokens, out.counts, out.idx_mapping,
                 self._none if drafts is None else drafts, tab, verdict,
                 n, out.tokens.shape[1], kept, -1 if expect_drafts is None else int(expect_drafts),
                 tab_s0, tab_s1),
                {"HAND_DRAFTS": drafts is not None, "HAS_TABLE": use_table,
                 **self._common, **self._release})

    def pack(self, buf: torch.Tensor, stage: torch.Tensor, n: int, rows: SampledStep,
             verdict: torch.Tensor) -> None:
        args, kw = self._pack_call(buf, stage, n, rows.tokens, rows.num_sampled,
                                   rows.num_rejected, rows.drafts, verdict)
        self.pack_kernel[(1,)](*args, **kw)

    def release(self, buf: torch.Tensor, stage: torch.Tensor, n: int,
                expect_drafts: bool | None, out: Outputs, table: torch.Tensor | None,
                kept: int, verdict: torch.Tensor) -> None:
        args, kw = self._release_call(buf, stage, n, expect_drafts, out, table, kept, verdict)
        self.release_kernel[(1,)](*args, **kw)


@contextmanager
def _on(device: torch.device) -> Iterator[None]:
    """``device`` current (Triton compiles for, and caches by, the current
    device), where its type has one."""
    module = getattr(torch, device.type, None)
    if device.index is None or module is None or not hasattr(module, "device"):
        yield
        return
    with module.device(device):
        yield
