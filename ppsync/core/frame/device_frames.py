"""The frame codec in torch ops: the frame lives where the tensors live.

Same layout, same bytes as the host frames (``ppsync.core.frame.layout``).
A frame packed here for a valid step equals the host
codec's frame word for word (the checksum is the same weighted sum, in
int64 arithmetic that wraps mod 2**64 in numpy and torch alike), so the
two codecs agree on what a frame is; a group still uses one codec (the
handshake compares it), because they report bad values at different times.

Host facts (the header words that come from the batch view, and each row's
slot_need and num_computed) are written on the host into a small staging
buffer (pinned on a device) and copied in with ``non_blocking``. Device
values (tokens, counts, drafts) never come to the host: the range checks of
num_sampled / num_rejected, the -1 padding and the checksum are torch ops.
Their outcome is a *verdict*: an int64 bit set (``V_*``), 0 when all is
well. The packer also sets FLAG_BAD_VALUES in the frame, so the verdict
travels to every receiver. Nothing here reads a device value on the host;
the host reads a verdict's staged copy once the step's event completed, and
only when it is non-zero does it look at the frame (the error path).
"""

from __future__ import annotations

import numpy as np
import torch

from ppsync.core.checks import value_bounds, value_error
from ppsync.core.frame.host_frames import FrameCodec
from ppsync.core.frame.layout import (
    FLAG_BAD_VALUES,
    HEADER_WORDS,
    BufferPool,
    FrameView,
    Header,
    Staging,
)
from ppsync.errors import BatchError
from ppsync.schemas.config import SyncConfig

_H_FLAGS, _H_CSUM = int(Header.FLAGS), int(Header.CHECKSUM)

V_NUM_SAMPLED = 1
"""A num_sampled value lies outside [0, w]."""
V_NUM_REJECTED = 2
"""A num_rejected value lies outside its bound (ppsync.core.checks.value_bounds)."""
V_FRAME = 4
"""The received frame disagrees with this rank's view (header, checksum,
row facts or digest): the host codec's check names how."""
V_FLAGGED = 8
"""The sender flagged bad values (FLAG_BAD_VALUES)."""
V_DRAFTS = 16
"""The frame's FLAG_HAS_DRAFTS disagrees with what the receiver expected."""


class DeviceFrameCodec:
    """Packs and checks frames with torch ops on ``device`` (CPU works too:
    the same code runs in CI over gloo)."""

    def __init__(self, config: SyncConfig, device: torch.device) -> None:
        self.layout = FrameCodec(config)
        """The host frames: the layout, digests, and the error path."""
        self.device = device
        lay = self.layout
        # built once: int64 weights on the device (the host codec's, word for word)
        self._payload_w = torch.from_numpy(lay.payload_w.copy()).to(device)
        self._header_w = torch.from_numpy(lay.header_w[:_H_CSUM].copy()).to(device)
        self.buffers = BufferPool(lay, device)

    def stage(self, staging: torch.Tensor, view: FrameView, flags: int) -> torch.Tensor:
        """Write ``view``'s host facts into ``staging`` (host, see
        :class:`~ppsync.core.frame.layout.Staging`); return the used part.
        The checksum word is left 0: the device computes it."""
        lay, n = self.layout, view.num_reqs
        s = staging.numpy()
        s[:HEADER_WORDS] = (*view.header_words(lay, flags), 0)
        s[Staging.slot_need(n)] = 0 if view.slot_need_np is None else view.slot_need_np
        s[Staging.computed(n)] = 0 if view.computed_np is None else view.computed_np
        return staging[: Staging.view_words(n)]

    def _checksum(self, buf: torch.Tensor, n: int) -> torch.Tensor:
        """[1] int64: the host codec's weighted sum, on the device (wraps)."""
        m = n * self.layout.row_width
        payload = buf[HEADER_WORDS : self.layout.used(n)]
        total = (payload * self._payload_w[:m]).sum() + (buf[:_H_CSUM] * self._header_w).sum()
        return total.view(1)

    def _value_verdict(self, ns: torch.Tensor, nr: torch.Tensor, w: int,
                       step_width: int) -> torch.Tensor:
        max_ns, max_nr = value_bounds(w, self.layout.num_drafts, step_width)
        bad_ns = ((ns < 0) | (ns > max_ns)).any().to(torch.int64)
        bad_nr = ((nr < 0) | (nr > max_nr)).any().to(torch.int64)
        return bad_ns * V_NUM_SAMPLED + bad_nr * V_NUM_REJECTED

    def pack(
        self,
        buf: torch.Tensor,  # [words] int64 on the device
        staged: torch.Tensor,  # [8 + 2 * num_reqs] int64, host facts (see stage)
        tokens: torch.Tensor,  # [num_reqs, w] int64
        num_sampled: torch.Tensor,  # [num_reqs] int
        num_rejected: torch.Tensor,  # [num_reqs] int
        drafts: torch.Tensor | None,  # [num_reqs, K] int, None = no drafts
    ) -> torch.Tensor:
        """Write one step into ``buf`` on the current stream; return its
        verdict, a [1] int64 device tensor (0: the values are in range)."""
        lay = self.layout
        n, L, K = tokens.shape[0], lay.sample_width, lay.num_drafts
        w = tokens.shape[1]
        facts = staged.to(self.device, non_blocking=True)
        rows = lay.device_rows(buf, n)
        rows[:, :w] = tokens
        if w < L:
            rows[:, w:L] = -1
        rows[:, lay.col_num_sampled] = num_sampled
        rows[:, lay.col_num_rejected] = num_rejected
        if K:
            if drafts is None:
                rows[:, lay.col_drafts : lay.col_slot_need] = -1
            else:
                rows[:, lay.col_drafts : lay.col_slot_need] = drafts
        rows[:, lay.col_slot_need] = facts[Staging.slot_need(n)]
        rows[:, lay.col_computed] = facts[Staging.computed(n)]
        buf[:_H_CSUM] = facts[:_H_CSUM]
        step_width = int(staged[Header.SAMPLE_WIDTH])  # host memory: this rank wrote it
        verdict = self._value_verdict(num_sampled, num_rejected, w, step_width).view(1)
        # the verdict travels: a bad step's frame says so, under the checksum
        flagged = (verdict != 0).to(torch.int64) * FLAG_BAD_VALUES
        buf[_H_FLAGS : _H_FLAGS + 1].bitwise_or_(flagged)
        buf[_H_CSUM : _H_CSUM + 1] = self._checksum(buf, n)
        return verdict

    def check(self, buf: torch.Tensor, staged: torch.Tensor, n: int, w: int) -> torch.Tensor:
        """Check a received frame against this rank's view (``staged``: the
        expected header words and row facts, see :meth:`stage`) on the
        current stream; return its [1] int64 verdict."""
        lay = self.layout
        exp = staged.to(self.device, non_blocking=True)
        head = buf[:HEADER_WORDS]
        rows = self.layout.device_rows(buf, n)
        bad_frame = (
            (head[:_H_FLAGS] != exp[:_H_FLAGS]).any()
            | (head[_H_FLAGS + 1 : _H_CSUM] != exp[_H_FLAGS + 1 : _H_CSUM]).any()
            | (self._checksum(buf, n) != head[_H_CSUM : _H_CSUM + 1]).any()
            | (rows[:, lay.col_slot_need] != exp[Staging.slot_need(n)]).any()
            | (rows[:, lay.col_computed] != exp[Staging.computed(n)]).any()
        ).to(torch.int64)
        flagged = ((head[_H_FLAGS] & FLAG_BAD_VALUES) != 0).to(torch.int64)
        verdict = (bad_frame * V_FRAME + flagged * V_FLAGGED
                   + self._value_verdict(rows[:, lay.col_num_sampled],
                                         rows[:, lay.col_num_rejected], w, w))
        return verdict.view(1)

    # -- the error path: the host looks at the frame only once a verdict is bad

    def value_error(self, frame_np: np.ndarray, n: int, w: int, step_width: int,
                    prefix: str) -> BatchError:
        """The BatchError naming the first bad num_sampled / num_rejected
        (field, row, value, rule) in a frame copied to the host."""
        lay = self.layout
        rows = lay.rows(frame_np, n)
        err = value_error(rows[:, lay.col_num_sampled], rows[:, lay.col_num_rejected], w=w,
                          num_drafts=lay.num_drafts, step_width=step_width, prefix=prefix)
        if err is None:  # flagged by its sender, though in range for this rank's width
            return BatchError(f"{prefix}values its sender flagged out of range (FLAG_BAD_VALUES)")
        return err
