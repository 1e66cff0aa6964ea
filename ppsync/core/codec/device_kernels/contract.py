"""The device kernels' contract: what a kernel set does for the device
codec (``DeviceKernels``) and where a receiver's release writes (``Outputs``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal, Protocol

import torch

from ppsync.core.frame.rows import SampledStep

TRITON_DEVICES = ("cuda", "xpu")
"""Devices Triton compiles for; on CPU tensors only its interpreter runs."""


@dataclass(slots=True)
class Outputs:
    """Where a receiver's release writes one step (allocated by the codec
    on the engine's main stream; the caller's own)."""

    tokens: torch.Tensor  # [n, w] int64
    counts: torch.Tensor  # [2, n] int32: num_sampled, then num_rejected
    idx_mapping: torch.Tensor  # [n] int64, -1 = excluded
    drafts: torch.Tensor | None  # [n, K] int64, or None: not handed out


class DeviceKernels(Protocol):
    """One kernel set's share of the device codec (current stream)."""

    name: Literal["torch", "triton"]

    def pack(self, buf: torch.Tensor, stage: torch.Tensor, n: int, rows: SampledStep,
             verdict: torch.Tensor) -> None:
        """Write one step's ``rows`` into ``buf`` ([words] int64): tokens with
        -1 padding to L, counts, drafts (-1 without), the row facts and
        header from ``stage`` (the staging buffer's device copy), the
        checksum; FLAG_BAD_VALUES when a count lies outside the staged
        bounds; ``verdict`` ([1] int64) gets V_NUM_SAMPLED / V_NUM_REJECTED."""

    def release(self, buf: torch.Tensor, stage: torch.Tensor, n: int,
                expect_drafts: bool | None, out: Outputs, table: torch.Tensor | None,
                kept: int, verdict: torch.Tensor) -> None:
        """Check a received frame against ``stage`` (this rank's view) and
        release it into ``out``; with ``table`` ([R, K]) and drafts handed
        out, scatter the ``kept`` kept rows' drafts into it when the frame
        has drafts. ``verdict`` ([1] int64) gets the V_* bits."""


def interpreting() -> bool:
    """Whether Triton runs its kernels in its interpreter (TRITON_INTERPRET)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
