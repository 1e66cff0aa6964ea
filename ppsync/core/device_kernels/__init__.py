"""The device codec's per-step work, as one of two kernel sets chosen once
(``SyncConfig.device_kernels``): torch ops, the reference
(ppsync.core.device_kernels.torch_set), or fused Triton kernels
(ppsync.core.device_kernels.triton_set, the optional extra
``ppsync[triton]``): one kernel packs, checks and checksums a step's frame on
the last rank; one checks a received frame and releases it on a receiver.

Both write the same frames, releases and verdicts. They run on the codec's
side stream, read the host facts from the step's staging copy on the device
(ppsync.core.frame.layout.Staging) and never read a device value on the host.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal, Protocol

import torch

from ppsync.core.frame.device_frames import DeviceFrames
from ppsync.errors import ConfigError
from ppsync.schemas.config import SyncConfig

__all__ = ["DeviceKernels", "Outputs", "device_kernels_for", "interpreting",
           "resolve_device_kernels", "triton_error"]

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

    def pack(self, buf: torch.Tensor, stage: torch.Tensor, n: int, tokens: torch.Tensor,
             num_sampled: torch.Tensor, num_rejected: torch.Tensor,
             drafts: torch.Tensor | None, verdict: torch.Tensor) -> None:
        """Write one step's frame into ``buf`` ([words] int64): tokens with
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


def triton_error() -> str | None:
    """Why the Triton kernels cannot be loaded here, or None when they can."""
    try:
        import ppsync.core.device_kernels.triton_jit  # noqa: F401
    except ImportError as e:
        return f"{type(e).__name__}: {e}"
    return None


def interpreting() -> bool:
    """Whether Triton runs its kernels in its interpreter (TRITON_INTERPRET)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def resolve_device_kernels(config: SyncConfig, device: torch.device
                           ) -> Literal["torch", "triton"]:
    """The kernel set ``config.device_kernels`` names for frames on
    ``device``: "auto" is Triton where it imports and ``device`` is CUDA or
    XPU, else torch ops; "triton" where it cannot run: a ConfigError naming
    why (no Triton; CPU tensors without Triton's interpreter)."""
    choice = config.device_kernels
    if choice == "torch":
        return "torch"
    compiled = device.type in TRITON_DEVICES
    if choice == "auto":
        return "triton" if compiled and triton_error() is None else "torch"
    why = triton_error()
    if why is not None:
        raise ConfigError(f"device_kernels = 'triton' but Triton cannot be loaded ({why}); "
                          "install the extra ppsync[triton], or use 'auto' or 'torch'")
    if not compiled and not interpreting():
        raise ConfigError(f"device_kernels = 'triton' on a {device.type} device needs "
                          "Triton's interpreter (TRITON_INTERPRET=1 before the process "
                          f"starts): Triton compiles for {', '.join(TRITON_DEVICES)} only")
    return "triton"


def device_kernels_for(config: SyncConfig, frames: DeviceFrames) -> DeviceKernels:
    """The device kernels ``config`` names for ``frames`` (built once)."""
    if resolve_device_kernels(config, frames.device) == "triton":
        from ppsync.core.device_kernels.triton_set import TritonKernels
        return TritonKernels(frames)
    from ppsync.core.device_kernels.torch_set import TorchKernels
    return TorchKernels(frames)
