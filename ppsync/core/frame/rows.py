"""A step's rows, declared once: the frame's row columns and the two records
that carry a step's per-row values on either side of the token path.

- ``ROW_COLUMNS``: a row's columns in frame order (laid out by
  ppsync.core.frame.layout.row_columns);
- :class:`SampledStep`: what the last rank hands the token path for one step
  (its sampler's outputs and drafts, and the step's width): built once, at
  the edge, by whatever engine adapter calls ``publish``, and taken whole by
  the token path, the services and the codecs;
- :class:`ReleasedStep`: what a receiver's consume hands back.

The sender's record names its columns as ``ROW_COLUMNS`` does (``tokens``,
``num_sampled``, ``num_rejected``, ``drafts``; ``SENT_COLUMNS``), and the
value rules (ppsync.core.rules.checks) name their fields by these names in
their errors. The remaining columns (``slot_need``, ``num_computed``) come
from the batch view, not from the sampler.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic

import numpy as np
import torch
from typing_extensions import TypeVar  # PEP 696 defaults before 3.13; torch requires it

ROW_COLUMNS: tuple[tuple[str, int | str], ...] = (
    ("tokens", "L"),  # the sampled tokens, -1 beyond the step's width w
    ("num_sampled", 1),
    ("num_rejected", 1),
    ("drafts", "K"),  # -1 when the frame carries no drafts
    ("slot_need", 1),  # 2 * idx + need
    ("num_computed", 1),  # num_computed_tokens
)
"""A row's columns in order: (name, width in words: an int, or "L" / "K"
for the sample width / the number of drafts). Adding a column is a line
here (and a field of :class:`~ppsync.core.frame.layout.Columns` for the
kernels to name it; a column the sampler fills is a field of
:class:`SampledStep` too)."""

SENT_COLUMNS = ("tokens", "num_sampled", "num_rejected", "drafts")
"""The columns a :class:`SampledStep` fills, by its fields' names (the
others come from the batch view)."""


Values = TypeVar("Values", torch.Tensor, np.ndarray, default=torch.Tensor)
"""What a record's columns are: the engine's tensors (``SampledStep``, the
default), or the host codec's checked arrays (``SampledStep[np.ndarray]``)."""


@dataclass(slots=True)  # read-only by convention: frozen costs the hot path (docs/measured.md)
class SampledStep(Generic[Values]):
    """One step's sampled rows as the last rank hands them to ``publish``.

    The tensors are the engine's (on its device with the device codec): the
    token path reads them into its own frame before ``publish`` returns, so
    the engine may overwrite them after. Past the checks, the codecs and
    their kernel sets carry the same record: the checked tensors (device
    codec) or host arrays (host codec, ``SampledStep[np.ndarray]``)."""

    tokens: Values  # [num_reqs, w] int64, 1 <= w <= L (-1 padded past num_sampled)
    num_sampled: Values  # [num_reqs] int32
    num_rejected: Values  # [num_reqs] int32
    drafts: Values | None = None  # [num_reqs, K] int64; None: the frame goes without
    sample_width: int | None = None
    """The step's width w (1..L; ``tokens`` at most w wide) for engines that
    vary it per step; None = L."""


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
