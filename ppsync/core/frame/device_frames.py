"""The device frames: the frame lives where the tensors live.

Same layout, same bytes as the host frames (``ppsync.core.frame.layout``).
A frame packed on the device for a valid step equals the host codec's frame
word for word (the checksum is the same weighted sum, in int64 arithmetic
that wraps mod 2**64 in numpy, torch and Triton alike), so the codecs agree
on what a frame is; a group still uses one codec (the handshake compares
it), because they report bad values at different times.

Host facts (the header words that come from the batch view, the value
bounds, and each row's slot_need and num_computed) are written on the host
into a small staging buffer (pinned on a device) and copied to the device
in one ``non_blocking`` copy. Device values (tokens, counts, drafts) never
come to the host: the range checks of num_sampled / num_rejected, the -1
padding and the checksum run on the device, in the kernel set chosen once
(ppsync.core.codec.device_kernels). Their outcome is a *verdict*: an int64 bit set
(``V_*``), 0 when all is well. The packer also sets FLAG_BAD_VALUES in the
frame, so the verdict travels to every receiver. Nothing reads a device
value on the host; the host reads a verdict's staged copy once the step's
event completed, and only when it is non-zero does it look at the frame
(the error path, here).
"""

from __future__ import annotations

import numpy as np
import torch

from ppsync.core.frame.layout import HEADER_WORDS, BufferPool, FrameView, Staging
from ppsync.core.frame.numpy_frames import NumpyFrames
from ppsync.core.rules.checks import value_error
from ppsync.errors import BatchError
from ppsync.schemas.config import SyncConfig

V_NUM_SAMPLED = 1
"""A num_sampled value lies outside [0, w]."""
V_NUM_REJECTED = 2
"""A num_rejected value lies outside its bound (ppsync.core.rules.checks.value_bounds)."""
V_FRAME = 4
"""The received frame disagrees with this rank's view (header, checksum,
row facts or digest): the host codec's check names how."""
V_FLAGGED = 8
"""The sender flagged bad values (FLAG_BAD_VALUES)."""
V_DRAFTS = 16
"""The frame's FLAG_HAS_DRAFTS disagrees with what the receiver expected."""


class DeviceFrames:
    """The device frames' host side for one configuration: the layout, the
    weights on the device, the staging of a step's host facts, and the error
    path. The per-step device work is a kernel set's
    (ppsync.core.codec.device_kernels: torch ops or Triton), chosen once."""

    def __init__(self, config: SyncConfig, device: torch.device) -> None:
        self.layout = NumpyFrames(config)
        """The host frames: the layout, digests, and the error path."""
        self.device = device
        lay = self.layout
        # built once: the host codec's int64 weights on the device, header
        # then payload (the checksum word weighted 0), word for word
        self.frame_w = torch.from_numpy(lay.frame_w.copy()).to(device)
        self.buffers = BufferPool(lay, device)

    def stage(self, s: np.ndarray, view: FrameView, flags: int,
              bounds: tuple[int, int]) -> None:
        """Write ``view``'s host facts into ``s``, a host staging buffer's
        memory (see :class:`~ppsync.core.frame.layout.Staging`): the header
        words (the checksum word 0: the device computes it), the value
        ``bounds`` (largest valid num_sampled, num_rejected) and the row facts."""
        n = view.num_reqs
        s[:HEADER_WORDS] = (*view.header_words(self.layout, flags), 0)
        s[Staging.bounds : Staging.bounds + 2] = bounds
        facts = s[Staging.facts(n)].reshape(n, 2)
        facts[:, 0] = 0 if view.slot_need_np is None else view.slot_need_np
        facts[:, 1] = 0 if view.computed_np is None else view.computed_np

    # -- the error path: the host looks at the frame only once a verdict is bad

    def value_error(self, frame_np: np.ndarray, n: int, w: int, step_width: int,
                    prefix: str) -> BatchError:
        """The BatchError naming the first bad num_sampled / num_rejected
        (field, row, value, rule) in a frame copied to the host."""
        lay = self.layout
        rows = lay.rows(frame_np, n)
        cols = lay.columns
        err = value_error(rows[:, cols.num_sampled.offset], rows[:, cols.num_rejected.offset], w=w,
                          num_drafts=lay.num_drafts, step_width=step_width, prefix=prefix)
        if err is None:  # flagged by its sender, though in range for this rank's width
            return BatchError(f"{prefix}values its sender flagged out of range (FLAG_BAD_VALUES)")
        return err
