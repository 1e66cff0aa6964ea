"""The device codec's per-step work, as one of two kernel sets chosen once
(``SyncConfig.device_kernels``): torch ops, the reference
(ppsync.core.codec.device_kernels.torch_set), or fused Triton kernels
(ppsync.core.codec.device_kernels.triton_set, the optional extra
``ppsync[triton]``): one kernel packs, checks and checksums a step's frame on
the last rank; one checks a received frame and releases it on a receiver.

Both write the same frames, releases and verdicts. They run on the codec's
side stream, read the host facts from the step's staging copy on the device
(ppsync.core.frame.layout.Staging) and never read a device value on the host.
"""

from __future__ import annotations

from typing import Literal

import torch

from ppsync.core.codec.device_kernels.contract import (
    TRITON_DEVICES,
    DeviceKernels,
    Outputs,
    interpreting,
)
from ppsync.core.codec.device_kernels.torch_set import TorchKernels
from ppsync.core.frame.device_frames import DeviceFrames
from ppsync.errors import ConfigError
from ppsync.schemas.config import SyncConfig

__all__ = ["TRITON_DEVICES", "DeviceKernels", "Outputs", "TorchKernels", "device_kernels_for",
           "interpreting", "resolve_device_kernels", "triton_error"]

def triton_error() -> str | None:
    """Why the Triton kernels cannot be loaded here, or None when they can."""
    try:
        import ppsync.core.codec.device_kernels.triton_jit  # noqa: F401
    except ImportError as e:
        return f"{type(e).__name__}: {e}"
    return None


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
        from ppsync.core.codec.device_kernels.triton_set import TritonKernels  # the optional extra
        return TritonKernels(frames)
    return TorchKernels(frames)
