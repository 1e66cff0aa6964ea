"""The host codec's per-step work, as one of two kernel sets chosen once
(``SyncConfig.host_kernels``): the numpy reference
(ppsync.core.host_kernels.numpy_set) or numba's compiled kernels
(ppsync.core.host_kernels.numba_set, the optional extra ``ppsync[jit]``).

Both give the same facts, frames, releases and errors; the choice is
rank-local (frames are the same word for word), so ranks need not agree.
"""

from __future__ import annotations

from typing import Literal

from ppsync.core.frame.host_frames import FrameCodec
from ppsync.core.host_kernels.numpy_set import NumpyKernels
from ppsync.errors import ConfigError
from ppsync.schemas.config import SyncConfig

__all__ = ["NumpyKernels", "host_kernels_for", "numba_error", "resolve_host_kernels"]


def numba_error() -> str | None:
    """Why the numba kernels cannot be loaded here, or None when they can.
    Loading them compiles them the first time on a machine (then numba's
    cache serves every process)."""
    try:
        import ppsync.core.host_kernels.jit  # noqa: F401
    except ImportError as e:
        return f"{type(e).__name__}: {e}"
    return None


def resolve_host_kernels(config: SyncConfig) -> Literal["numba", "numpy"]:
    """The kernel set ``config.host_kernels`` names here: "auto" is numba
    where it imports, else numpy; "numba" where it does not: a ConfigError."""
    choice = config.host_kernels
    if choice == "numpy":
        return "numpy"
    why = numba_error()
    if why is None:
        return "numba"
    if choice == "numba":
        raise ConfigError(f"host_kernels = 'numba' but numba cannot be loaded ({why}); "
                          "install the extra ppsync[jit], or use 'auto' or 'numpy'")
    return "numpy"


def host_kernels_for(config: SyncConfig, frames: FrameCodec) -> NumpyKernels:
    """The host kernels ``config`` names, for ``frames`` (compiled or loaded
    from numba's cache here, never inside a step)."""
    if resolve_host_kernels(config) == "numba":
        from ppsync.core.host_kernels.numba_set import NumbaKernels
        return NumbaKernels(frames)
    return NumpyKernels(frames)
