"""The records of a step between a token path's calls, as the codec makes
and reads them: a receive posted and waiting in the ring, and a last-rank
step that passed its checks."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from ppsync.core.frame import FrameView
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
    tokens_np: np.ndarray | None  # [num_reqs, w] int; None with the device codec
    num_sampled_np: np.ndarray | None  # [num_reqs] int; None with the device codec
    num_rejected_np: np.ndarray | None  # [num_reqs] int; None with the device codec
    sample_width: int | None = None  # the step's width w in the header; None = L
    outputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    """The device codec's unread (tokens, num_sampled, num_rejected)."""
