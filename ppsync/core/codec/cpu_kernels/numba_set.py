"""The numba CPU kernels: each role's per-step work in one compiled call
(ppsync.core.codec.cpu_kernels.jit), the numpy reference's results word for word.

Python keeps what is cheap there (type and shape checks, the header's words
in one ``struct`` call, the output arrays); a kernel does every value check
and every loop over rows. A kernel that finds a rule broken, or an argument
it has no signature for (another dtype, a read-only array), hands the call
to the numpy reference, which raises the typed error (or serves it): every
message and every result is the reference's.
"""

from __future__ import annotations

import struct

import numpy as np
import torch

from ppsync.core.codec.cpu_kernels import jit
from ppsync.core.codec.cpu_kernels.numpy_set import NumpyKernels, scatter_rows
from ppsync.core.codec.released import ReleasedStep
from ppsync.core.codec.steps import PendingStep
from ppsync.core.frame.layout import FRAME_FORMAT_VERSION, MAGIC, FrameView, Header
from ppsync.core.frame.numpy_frames import NumpyFrames
from ppsync.core.frame.rows import SampledStep
from ppsync.core.rules import BatchView
from ppsync.core.rules.checks import sampled_arrays, value_bounds
from ppsync.core.rules.facts import BatchFacts
from ppsync.core.rules.validate import plain_shapes_ok

_HEAD = struct.Struct(f"={int(Header.CHECKSUM)}q")
"""The header words before the checksum (the NumpyFrames's own packing)."""
_MAGIC = MAGIC | FRAME_FORMAT_VERSION
_NO_DRAFTS = np.empty((0, 0), dtype=np.int64)  # [0, 0]: no drafts, no table


class NumbaKernels(NumpyKernels):
    """The numba kernel set; its numpy reference serves what it does not."""

    name = "numba"

    def __init__(self, frames: NumpyFrames) -> None:
        super().__init__(frames)
        jit.warm()  # first-call setup here, not in the first step
        self._facts_w = frames.facts_w
        self._facts_w_sums = frames.facts_w_sums
        self._frame_w = frames.frame_w
        self._cols = jit.column_words(frames.columns)
        self.fallbacks = 0
        """Calls the numpy reference served (a broken rule, or arguments
        with no compiled signature): a figure for benchmarks and tests."""

    def facts(self, view: BatchView) -> BatchFacts:
        R = self.frames.max_num_reqs
        if not plain_shapes_ok(view, R):  # optional arrays, odd types: the reference
            self.fallbacks += 1
            return super().facts(view)
        n = view.num_reqs
        block = np.empty((3, n), dtype=np.int64)  # [3, n]: idx, slot_need, computed
        need = np.empty(n, dtype=np.bool_)  # [n]
        try:
            needed, digest = jit.batch_facts(
                view.idx_mapping_np, view.num_computed_tokens_np, view.num_scheduled_tokens_np,
                view.prefill_len_np, R, block, need, self._facts_w, self._facts_w_sums)
        except TypeError:  # no signature for these arrays
            self.fallbacks += 1
            return super().facts(view)
        if needed < 0:
            self.fallbacks += 1
            return super().facts(view)  # raises, naming the field and row
        return BatchFacts(block, need, needed, digest)

    def sampled(self, sampled: SampledStep, *, num_reqs: int) -> SampledStep[np.ndarray]:
        f = self.frames
        step_width = sampled.sample_width
        tokens_np, ns_np, nr_np = sampled_arrays(
            sampled.tokens, sampled.num_sampled, sampled.num_rejected, num_reqs=num_reqs,
            sample_width=f.sample_width)
        max_ns, max_nr = value_bounds(tokens_np.shape[1], f.num_drafts, step_width)
        try:
            ok = jit.values_ok(ns_np, nr_np, max_ns, max_nr) == 0
        except TypeError:
            ok = False
        if ok:
            return SampledStep(tokens_np, ns_np, nr_np, None, step_width)
        self.fallbacks += 1
        return super().sampled(sampled, num_reqs=num_reqs)

    def pack(self, buf_np: np.ndarray, frame: FrameView, rows: SampledStep[np.ndarray]
             ) -> tuple[int, int]:
        f = self.frames
        if frame.facts_np is None:  # a raw benchmark frame
            self.fallbacks += 1
            return super().pack(buf_np, frame, rows)
        drafts_np = rows.drafts
        has_drafts = f.num_drafts > 0 and drafts_np is not None
        flags = f.flags(has_drafts)
        _HEAD.pack_into(buf_np, 0, _MAGIC, frame.seq, frame.num_reqs,  # type: ignore[arg-type]
                        frame.width(f), f.num_drafts, flags, frame.idx_digest)
        f.clear_spare(buf_np, frame.num_reqs)
        try:
            checksum = jit.pack(buf_np, rows.tokens, rows.num_sampled, rows.num_rejected,
                                _NO_DRAFTS if drafts_np is None else drafts_np, has_drafts,
                                frame.facts_np, self._cols, self._frame_w)
        except TypeError:
            self.fallbacks += 1
            return super().pack(buf_np, frame, rows)
        return flags, int(checksum)

    def release(self, head: PendingStep, keep: np.ndarray, kept: int,
                table: torch.Tensor | None, rank: int) -> ReleasedStep:
        f, frame = self.frames, head.frame
        if frame.facts_np is None:
            self.fallbacks += 1
            return super().release(head, keep, kept, table, rank)
        n, K = frame.num_reqs, f.num_drafts
        tokens = np.empty((n, frame.width(f)), dtype=np.int64)  # [n, w]
        counts = np.empty((2, n), dtype=np.int32)  # [2, n]: num_sampled, num_rejected
        # every row kept (the usual step): the posted step's own idx copy
        idx_out = head.idx_np if kept == n else np.empty(n, dtype=np.int64)  # [n]
        drafts = np.empty((n, K), dtype=np.int64) if K else _NO_DRAFTS  # [n, K]
        on_host = table is not None and table.device.type == "cpu"
        try:
            flags = jit.release(
                head.buf.numpy(), _MAGIC, frame.seq, frame.width(f), frame.idx_digest,
                frame.facts_np, keep, head.idx_np,
                -1 if head.expect_drafts is None else int(head.expect_drafts),
                tokens, counts, idx_out, drafts,
                table.numpy() if on_host else _NO_DRAFTS,  # type: ignore[union-attr]
                on_host, self._cols, self._frame_w)
        except TypeError:
            flags = jit.BAD
        if flags < 0:  # the reference raises the frame's error
            self.fallbacks += 1
            return super().release(head, keep, kept, table, rank)
        has_drafts = bool(flags & 1) and K > 0
        if has_drafts and table is not None and not on_host:
            sel = slice(None) if kept == n else keep
            scatter_rows(table, head.idx_np[sel], drafts[sel])
        return ReleasedStep(
            seq=frame.seq,
            sampled_tokens=torch.from_numpy(tokens),
            num_sampled=torch.from_numpy(counts[0]),
            num_rejected=torch.from_numpy(counts[1]),
            idx_mapping=torch.from_numpy(idx_out),
            draft_tokens=torch.from_numpy(drafts) if has_drafts else None,
            kept_np=keep,
        )
