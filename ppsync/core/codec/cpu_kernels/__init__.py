"""The host codec's per-step work, as one of two kernel sets chosen once
(``SyncConfig.cpu_kernels``): the numpy reference
(ppsync.core.codec.cpu_kernels.numpy_set) or numba's compiled kernels
(ppsync.core.codec.cpu_kernels.numba_set, the optional extra ``ppsync[jit]``).

Both give the same facts, frames, releases and errors; the choice is
rank-local (frames are the same word for word), so ranks need not agree.
"""

from __future__ import annotations

from typing import Literal, Protocol

import numpy as np
import torch

from ppsync.core.codec.cpu_kernels.numpy_set import NumpyKernels
from ppsync.core.codec.released import ReleasedStep
from ppsync.core.codec.steps import PendingStep
from ppsync.core.frame.layout import FrameView
from ppsync.core.frame.numpy_frames import NumpyFrames
from ppsync.core.frame.rows import SampledStep
from ppsync.core.rules import BatchView
from ppsync.core.rules.facts import BatchFacts
from ppsync.errors import ConfigError
from ppsync.schemas.config import SyncConfig

__all__ = ["CpuKernels", "NumpyKernels", "cpu_kernels_for", "numba_error",
           "resolve_cpu_kernels"]


class CpuKernels(Protocol):
    """One kernel set's share of the host codec (and of a step's batch
    facts, for both codecs)."""

    name: str
    frames: NumpyFrames

    def facts(self, view: BatchView) -> BatchFacts:
        """Check ``view`` and derive its facts, need mask and digest."""

    def sampled(self, sampled: SampledStep, *, num_reqs: int) -> SampledStep[np.ndarray]:
        """Check one step's sampled rows but its drafts (last rank); the
        record of their host arrays (drafts None)."""

    def pack(self, buf_np: np.ndarray, frame: FrameView, rows: SampledStep[np.ndarray]
             ) -> tuple[int, int]:
        """Write one checked step's rows (its drafts in ``rows.drafts``, or
        None) into ``buf_np``; (flags, checksum)."""

    def release(self, head: PendingStep, keep: np.ndarray, kept: int,
                table: torch.Tensor | None, rank: int) -> ReleasedStep:
        """Check ``head``'s received frame against this rank's view and
        read out its rows; kept rows' drafts scattered into ``table``."""


def numba_error() -> str | None:
    """Why the numba kernels cannot be loaded here, or None when they can.
    Loading them compiles them the first time on a machine (then numba's
    cache serves every process)."""
    try:
        import ppsync.core.codec.cpu_kernels.jit  # noqa: F401
    except Exception as e:
        # numba compiles at import: besides a missing numba, its on-disk
        # cache can fail to load (seen: a cache written by another numba,
        # LLVM 22, on one source tree shared by two environments, raised
        # "LLVM bitcode parsing error" in the other, LLVM 20)
        return f"{type(e).__name__}: {e}"
    return None


def resolve_cpu_kernels(config: SyncConfig) -> Literal["numba", "numpy"]:
    """The kernel set ``config.cpu_kernels`` names here: "auto" is numba
    where it imports, else numpy; "numba" where it does not: a ConfigError."""
    choice = config.cpu_kernels
    if choice == "numpy":
        return "numpy"
    why = numba_error()
    if why is None:
        return "numba"
    if choice == "numba":
        raise ConfigError(f"cpu_kernels = 'numba' but numba cannot be loaded ({why}); "
                          "install the extra ppsync[jit], or use 'auto' or 'numpy'")
    return "numpy"


def cpu_kernels_for(config: SyncConfig, frames: NumpyFrames) -> CpuKernels:
    """The CPU kernels ``config`` names, for ``frames`` (compiled or loaded
    from numba's cache here, never inside a step)."""
    if resolve_cpu_kernels(config) == "numba":
        from ppsync.core.codec.cpu_kernels.numba_set import NumbaKernels
        return NumbaKernels(frames)
    return NumpyKernels(frames)
