"""The device kernels in torch ops: the reference, and what runs where
Triton does not (CPU tensors, a device without Triton).

Lean by construction: the staged host facts arrive in one copy
(ppsync.core.frame.layout.Staging), the rows are written by one ``cat`` of
their pieces in the layout's column order (its Columns), the checksum is
one product and one sum over the frame's used prefix, the value checks
are one clamp against the staged bounds, and a release writes into the
codec's tensors instead of making fresh ones.
"""

from __future__ import annotations

from typing import Literal

import torch

from ppsync.core.codec.device_kernels.contract import Outputs
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
    Column,
    Header,
    Staging,
)
from ppsync.core.frame.rows import SampledStep

_H_FLAGS, _H_CSUM = int(Header.FLAGS), int(Header.CHECKSUM)

Piece = str | torch.Tensor
"""A piece of the row as pack writes it: a source's name, or a spare
column's zeros ([R, width])."""


class TorchKernels:
    """The device codec's per-step work as torch ops."""

    name: Literal["torch", "triton"] = "torch"

    def __init__(self, frames: DeviceFrames) -> None:
        lay = frames.layout
        dev = frames.device
        self.layout = lay
        self.frame_w = frames.frame_w
        self.L, self.K, self.W = lay.sample_width, lay.num_drafts, lay.row_width
        self.staging = lay.staging
        cols = lay.columns
        self._tok = cols.tokens.offset
        self._counts, self._facts_at = cols.counts, cols.facts  # [n, 2] each
        self._drafts_at = slice(cols.drafts.offset, cols.drafts.end)
        # the row's pieces in column order: tokens (then their -1 padding),
        # the counts and the facts as [n, 2] blocks, drafts, spare zeros
        pieces: list[tuple[Column, Piece]] = [
            (cols.tokens, "tokens"), (cols.num_sampled, "counts"), (cols.drafts, "drafts"),
            (cols.slot_need, "facts"),
            *((c, torch.zeros((lay.max_num_reqs, c.width), dtype=torch.int64, device=dev))
              for c in cols.spare)]
        self._plan = [piece for col, piece in sorted(pieces, key=lambda p: p[0].offset)
                      if col.width]
        # built once: what the checks compare with and weigh by
        self._value_bits = torch.tensor([V_NUM_SAMPLED, V_NUM_REJECTED], device=dev)
        self._zeros = torch.zeros(2, dtype=torch.int64, device=dev)
        head_mask = torch.full((HEADER_WORDS,), -1, dtype=torch.int64)
        head_mask[[_H_FLAGS, _H_CSUM]] = 0  # the header words a receiver does not compare
        self._head_mask = head_mask.to(dev)
        flag_bad = torch.zeros(HEADER_WORDS, dtype=torch.int64)
        flag_bad[_H_FLAGS] = FLAG_BAD_VALUES
        self._flag_bad = flag_bad.to(dev)
        self._neg1 = torch.full((lay.max_num_reqs, max(lay.sample_width, lay.num_drafts)), -1,
                                dtype=torch.int64, device=dev)
        self._m1 = self._neg1[0, 0]  # [] -1: what a failed frame hands out

    def _facts(self, stage: torch.Tensor, n: int) -> torch.Tensor:
        return stage[Staging.facts(n)].view(n, 2)

    def _bad_values(self, counts: torch.Tensor, stage: torch.Tensor) -> torch.Tensor:
        """[] int64: V_NUM_SAMPLED / V_NUM_REJECTED for ``counts`` [n, 2]
        (num_sampled, num_rejected) outside [0, the staged bounds]."""
        bounds = stage[Staging.bounds : Staging.bounds + 2]
        bad = (counts.clamp(min=self._zeros, max=bounds) != counts).any(0)
        verdict: torch.Tensor = (bad * self._value_bits).sum()
        return verdict

    def _weighted(self, buf: torch.Tensor, n: int) -> torch.Tensor:
        """The used prefix times the host codec's weights (the checksum word
        weighted 0): its sum, wrapping, is the checksum."""
        end = HEADER_WORDS + n * self.W
        return buf[:end] * self.frame_w[:end]

    def _checksum(self, buf: torch.Tensor, n: int) -> torch.Tensor:
        """[] int64: the frame's checksum as its words are now."""
        return self._weighted(buf, n).sum()

    def pack(self, buf: torch.Tensor, stage: torch.Tensor, n: int, sampled: SampledStep,
             verdict: torch.Tensor) -> None:
        tokens, drafts = sampled.tokens, sampled.drafts
        L, K, w = self.L, self.K, tokens.shape[1]
        rows = self.layout.device_rows(buf, n)
        counts = torch.stack((sampled.num_sampled, sampled.num_rejected), 1)
        source = {"tokens": tokens, "counts": counts, "facts": self._facts(stage, n)}
        if K:
            source["drafts"] = self._neg1[:n, :K] if drafts is None else drafts
        # every column of the rows in one write, in the layout's order
        parts = []
        for piece in self._plan:
            if not isinstance(piece, str):
                parts.append(piece[:n])  # a spare column's zeros
                continue
            parts.append(source[piece])
            if piece == "tokens" and w < L:
                parts.append(self._neg1[:n, : L - w])
        torch.cat(parts, 1, out=rows)
        v = self._bad_values(counts, stage)
        # the header, with FLAG_BAD_VALUES when a count is out of range: the
        # verdict travels, under the checksum
        torch.bitwise_or(stage[:HEADER_WORDS], (v != 0) * self._flag_bad, out=buf[:HEADER_WORDS])
        torch.sum(self._weighted(buf, n), 0, keepdim=True, out=buf[_H_CSUM : _H_CSUM + 1])
        verdict.copy_(v)

    def release(self, buf: torch.Tensor, stage: torch.Tensor, n: int,
                expect_drafts: bool | None, out: Outputs, table: torch.Tensor | None,
                kept: int, verdict: torch.Tensor) -> None:
        st = self.staging
        rows = self.layout.device_rows(buf, n)
        head = buf[:HEADER_WORDS]
        counts = rows[:, self._counts]
        bad_frame = (((head ^ stage[:HEADER_WORDS]) & self._head_mask).any()
                     | (self._checksum(buf, n) != head[_H_CSUM])
                     | (rows[:, self._facts_at] != self._facts(stage, n)).any())
        flags = head[_H_FLAGS]
        has = (flags & FLAG_HAS_DRAFTS) != 0
        v = (bad_frame * V_FRAME + ((flags & FLAG_BAD_VALUES) != 0) * V_FLAGGED
             + self._bad_values(counts, stage))
        if expect_drafts is not None:
            v = v + (has != expect_drafts) * V_DRAFTS
        verdict.copy_(v)
        # a frame that fails its check releases nothing: every row excluded,
        # num_sampled 0, tokens and drafts -1, the table as it was; chosen on
        # the device (no host sync): the error comes when the verdict is read
        ok = v == 0
        m1 = self._m1
        tok = self._tok
        torch.where(ok, rows[:, tok : tok + out.tokens.shape[1]], m1, out=out.tokens)
        out.counts.copy_(torch.where(ok, counts.t(), self._zeros[0]))
        torch.where(ok, stage[st.idx_out : st.idx_out + n], m1, out=out.idx_mapping)
        if out.drafts is None:
            return
        torch.where(ok, rows[:, self._drafts_at], m1, out=out.drafts)
        if table is not None and kept:
            # rule 4: kept rows only; a frame without drafts, or failed, leaves
            # the table: its kept rows are written back as they were (torch
            # ops cannot skip the write without reading the verdict on the host)
            slots = stage[st.kept_slots : st.kept_slots + kept]
            picked = out.drafts.index_select(0, stage[st.kept_rows : st.kept_rows + kept])
            table.index_copy_(0, slots, torch.where(has & ok, picked.to(table.dtype),
                                                    table.index_select(0, slots)))
