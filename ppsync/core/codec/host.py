"""The host codec: frames packed and checked on the host, by the host
kernels chosen once (ppsync.core.codec.cpu_kernels: numpy, or numba's).

Every value of a step is checked before its frame is sent (a bad one raises
at that call, before any collective). A consume copies what it hands out of
the received frame: the step's rows as a ReleasedStep, excluded rows at -1,
and the drafts of kept rows scattered into the engine's draft table (rule 4).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
import torch.distributed as dist

from ppsync.core.codec.cpu_kernels import cpu_kernels_for
from ppsync.core.codec.protocol import Issue, StepDrafts, Wait
from ppsync.core.codec.released import ReleasedStep
from ppsync.core.codec.steps import PendingStep, PreparedStep
from ppsync.core.frame.layout import BufferPool, FrameView
from ppsync.core.frame.numpy_frames import NumpyFrames
from ppsync.core.frame.rows import SampledStep
from ppsync.core.rules import BatchView
from ppsync.core.rules.checks import (
    check_draft_table,
    check_drafts_array,
    check_step_drafts,
    check_width_fits,
)
from ppsync.core.rules.facts import BatchFacts
from ppsync.errors import BatchError
from ppsync.schemas.config import SyncConfig


class HostCodec:
    """The host codec's share of a token path (see ppsync.core.codec.protocol)."""

    on_device = False
    device_kernels_name = "none"

    def __init__(self, config: SyncConfig) -> None:
        self.frames = NumpyFrames(config)
        self.kernels = cpu_kernels_for(config, self.frames)
        self.device = torch.device("cpu")
        self.buffers = BufferPool(self.frames)

    def settle(self, all_: bool = False) -> None:
        """Nothing is deferred: every value was checked before its send."""

    # -- last rank --------------------------------------------------------

    def prepare(
        self, view: BatchView, facts: BatchFacts, sampled: SampledStep,
    ) -> tuple[PreparedStep, np.ndarray | None]:
        rows = self.kernels.sampled(sampled, num_reqs=view.num_reqs)
        drafts_np = None if sampled.drafts is None else check_step_drafts(
            sampled.drafts, num_reqs=view.num_reqs, num_drafts=self.frames.num_drafts)
        check_width_fits(rows.tokens.shape[1], sampled.sample_width)
        return PreparedStep(view, facts, rows), drafts_np

    def check_drafts(self, drafts: object, num_reqs: int) -> StepDrafts:
        check_drafts_array(drafts, num_reqs=num_reqs, num_drafts=self.frames.num_drafts)
        assert isinstance(drafts, np.ndarray)  # checked just above
        return drafts

    def step_drafts(self, drafts: object, num_reqs: int) -> StepDrafts:
        return check_step_drafts(drafts, num_reqs=num_reqs, num_drafts=self.frames.num_drafts)

    def check_draft_table(self, table: object) -> object:
        return check_draft_table(table, max_num_reqs=self.frames.max_num_reqs,
                                 num_drafts=self.frames.num_drafts)

    def gather_drafts(self, table: object, idx: np.ndarray) -> StepDrafts:
        assert isinstance(table, np.ndarray)  # check_draft_table returned it
        rows: np.ndarray = table[idx]  # [num_reqs, K], owns its memory
        return rows

    def send(self, frame: FrameView, step: PreparedStep, drafts: StepDrafts | None,
             issue: Issue) -> tuple[torch.Tensor, dist.Work, int, int]:
        r = step.rows
        if not isinstance(r.tokens, np.ndarray):
            raise BatchError("step was prepared for the device codec; this path uses "
                             "the host codec")
        assert not isinstance(drafts, torch.Tensor)  # check_drafts returned a host array
        rows = r
        if drafts is not None:
            rows = SampledStep(rows.tokens, rows.num_sampled, rows.num_rejected, drafts,
                               rows.sample_width)
        buf = self.buffers.take(frame.num_reqs)
        flags, checksum = self.kernels.pack(buf.numpy(), frame, rows)
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
        released = self.kernels.release(head, keep, kept, table, rank)
        self.buffers.give(head.buf)  # everything released was copied out
        return released

    def skip(self, head: PendingStep) -> None:
        """Nothing to give back: the buffer returns once its transfer completed."""

    def pump(self, wait: bool = False) -> None:
        """Nothing waits: host frames are issued as they are packed."""

    def hurry(self) -> bool:
        return False

    def on_deferred(self, wake: Callable[[], None]) -> None:
        """Nothing waits: never called."""

    def close(self) -> None:
        """Nothing to end: the host codec keeps no stream."""

    def reuse(self, buf: torch.Tensor) -> None:
        self.buffers.give(buf)
