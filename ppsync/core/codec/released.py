"""What a consumer hands the engine for one released step."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(slots=True)  # read-only by convention: frozen costs the hot path (docs/measured.md)
class ReleasedStep:
    """Step ``seq``'s outputs, D steps after its receive was posted.

    Rows that needed no sample, or whose request slot was freed since the
    receive was posted, are excluded: their ``idx_mapping`` entry is -1 and
    consumers skip them."""

    seq: int
    sampled_tokens: torch.Tensor  # [num_reqs, L] int64, padded with -1
    num_sampled: torch.Tensor  # [num_reqs] int32
    num_rejected: torch.Tensor  # [num_reqs] int32
    idx_mapping: torch.Tensor  # [num_reqs] int64, -1 = excluded
    draft_tokens: torch.Tensor | None  # [num_reqs, K] int64; None when the frame had none
    kept_np: np.ndarray  # [num_reqs] bool

    @property
    def num_reqs(self) -> int:
        return int(self.kept_np.shape[0])

    @property
    def num_kept(self) -> int:
        return int(self.kept_np.sum())
