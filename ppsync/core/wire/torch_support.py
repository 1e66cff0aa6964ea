"""Which torch ppsync runs on: the releases that the supported vLLM releases
pin (vLLM 0.23 to 0.25: torch 2.11.0; 0.28 to 0.32: 2.13.0; 0.33 and 0.34:
2.14.0; read from each release's wheel metadata), as pyproject.toml
declares them. ppsync runs inside the engine's torch, so these are the
versions its tests run on (``make torch-range-test``), not only the newest.

An older torch is refused when ppsync.core is imported: its ``Work`` and
process-group bindings are not the ones ppsync was checked against.
"""

from __future__ import annotations

import re

import torch

TORCH_OLDEST = (2, 11)
"""The oldest torch (major, minor) supported: vLLM 0.23's."""
TORCH_NEWEST = (2, 14)
"""The newest torch (major, minor) tested: vLLM 0.34's."""


def torch_release(version: str) -> tuple[int, int]:
    """(major, minor) of a torch version string ("2.11.0+cu130", an NGC
    build's "2.11.0a0+git...": a pre-release counts as its release)."""
    m = re.match(r"(\d+)\.(\d+)", version)
    if m is None:
        raise ImportError(f"ppsync: cannot read torch's version {version!r}")
    return int(m.group(1)), int(m.group(2))


def require_supported_torch(version: str = str(torch.__version__)) -> None:
    """ImportError naming the version and the range when torch is older
    than :data:`TORCH_OLDEST`."""
    if torch_release(version) < TORCH_OLDEST:
        oldest = ".".join(map(str, TORCH_OLDEST))
        newest = ".".join(map(str, TORCH_NEWEST))
        raise ImportError(f"ppsync needs torch >= {oldest} (supported: {oldest} to {newest}, "
                          f"the releases vLLM 0.23 to 0.34 pin); this is torch {version}")


require_supported_torch()
