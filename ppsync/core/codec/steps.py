"""The records of a step between a token path's calls, as the codec makes
and reads them: a receive posted and waiting in the ring, and a last-rank
step that passed its checks."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from ppsync.core.frame import FrameView
from ppsync.core.frame.rows import SampledStep
from ppsync.core.rules import BatchView
from ppsync.core.rules.facts import BatchFacts


@dataclass(slots=True)
class PendingStep:
    """A posted receive, waiting in the ring for its consume."""

    frame: FrameView
    need_np: np.ndarray  # [num_reqs] bool
    needed: int  # need_np.sum()
    idx_np: np.ndarray  # [num_reqs] int64, a copy of the batch's idx_mapping
    freed_mark: int  # GenerationTable.mark() when posted (rule 3)
    buf: torch.Tensor  # [words] int64 frame buffer the receive fills
    work: dist.Work
    expect_drafts: bool | None = None  # None: take the frame's word for it
    staging: torch.Tensor | None = None  # device codec: host facts of this rank's view


@dataclass(slots=True)  # read-only by convention: frozen costs the hot path (docs/measured.md)
class PreparedStep:
    """A last-rank step whose inputs passed every check; ready to send."""

    view: BatchView
    facts: BatchFacts  # the view's checked facts and need mask (own copies)
    rows: SampledStep[np.ndarray] | SampledStep[torch.Tensor]
    """The checked rows, drafts apart (send takes them): host arrays (host
    codec) or the engine's unread tensors (device codec)."""

    @property
    def sample_width(self) -> int | None:
        """The step's width w in the header; None = L."""
        return self.rows.sample_width
