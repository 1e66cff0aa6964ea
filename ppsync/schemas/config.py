"""Configuration of one rank's token path.

Vocabulary used throughout ppsync:

- *rank*: a process in the pipeline-parallel (PP) group; the *last rank*
  (group rank pp_size - 1) samples tokens, every other rank receives them.
- *step*: one engine step; every rank counts steps the same way.
- *row*: one request's line in a step's batch (``num_reqs`` rows).
- *request slot index*: where a row's request lives, ``idx_mapping[row]`` in
  ``[0, max_num_reqs)``; reused once the request ends.
- *ring slot*: one of the ``ring_depth`` (D) pending steps a non-last rank
  keeps between posting a receive and consuming it.
- K = ``num_speculative_steps``; L = K + 1 is the sample width.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ppsync.errors import ConfigError
from ppsync.schemas._validate import validate_as

WireMode = Literal["fixed", "exact"]
CodecName = Literal["host", "device"]
HostKernelsName = Literal["auto", "numba", "numpy"]
DeviceKernelsName = Literal["auto", "triton", "torch"]
EmulatedName = Literal["nccl", "xccl"]
"""The backends whose completion semantics the CPU twin emulates (``--emulate``)."""

DEFAULT_TIMEOUT_S = 60.0
"""The bound on every wait when none is given: SyncConfig's, the handler's
and the ``ppsync`` command's ``--timeout``."""


class SyncConfig(BaseModel):
    """What every rank of one PP group must agree on."""

    # strict: no bool-as-int, no numeric strings; every rank must mean the same
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True,
                              use_attribute_docstrings=True)

    pp_size: int = Field(ge=1, le=1024)
    """Number of ranks in the PP group (P)."""
    max_num_reqs: int = Field(ge=1, le=1 << 20)
    """Request slots; idx_mapping values lie in [0, max_num_reqs)."""
    num_speculative_steps: int = Field(default=0, ge=0, le=64)
    """K: draft tokens per request per step; the sample width is L = K + 1."""
    ring_depth: int | None = Field(default=None, ge=1, le=1024)
    """D: steps between posting a receive and consuming it (None = pp_size)."""
    timeout_s: float = Field(default=DEFAULT_TIMEOUT_S, gt=0, le=86400)
    """Bound on every wait: a transfer, a consumer wait, the group's collectives."""
    wire: WireMode = "fixed"
    """'fixed': frames sized for max_num_reqs rows (mismatched num_reqs cannot
    deadlock); 'exact': frames sized for num_reqs rows (fewer bytes)."""
    codec: CodecName = "host"
    """'host': frames packed and checked with numpy on the host (the CPU
    default); 'device': with torch ops where the tensors live, checks
    deferred by one step (what a GPU needs: no host sync per step). Every
    rank must use the same codec (the handshake compares it)."""
    host_kernels: HostKernelsName = "auto"
    """The host path's per-step kernels: 'numba' (compiled calls: the view's
    facts, the sampler values, the pack; the frame's check and release;
    the extra ppsync[jit]), 'numpy' (the reference), or 'auto'
    (numba where it can be loaded, else numpy). Both give the same frames,
    releases and errors; a rank-local setting: ranks need not agree."""
    device_kernels: DeviceKernelsName = "auto"
    """The device codec's per-step kernels: 'triton' (one fused kernel per
    step and role: pack, checks, checksum and verdict on the last rank;
    frame check and release on a receiver; the extra ppsync[triton]),
    'torch' (torch ops, the reference), or 'auto' (Triton where it imports
    and the device is CUDA or XPU, else torch ops). Both give the same
    frames, releases and errors; the handshake compares the set each rank
    chose. The host codec ignores it."""
    flight_events: int = Field(default=4096, ge=0, le=1 << 18)
    """Events the flight recorder keeps (the newest; 0 = recorder off). A
    rank-local setting: ranks need not agree on it."""

    @model_validator(mode="after")
    def _depth_within_pp_size(self) -> SyncConfig:
        if self.ring_depth is not None and self.ring_depth > self.pp_size:
            raise ValueError(
                f"ring_depth = {self.ring_depth} exceeds pp_size = {self.pp_size}; "
                "allowed 1..pp_size"
            )
        return self

    @classmethod
    def build(cls, **fields: object) -> SyncConfig:
        """Validate ``fields``; raise :class:`ConfigError` naming each bad field."""
        return validate_as(cls, fields, ConfigError)

    @property
    def sample_width(self) -> int:
        """L = K + 1: the most tokens one row can carry per step."""
        return self.num_speculative_steps + 1

    @property
    def depth(self) -> int:
        """The ring depth D in force (ring_depth, or pp_size when unset)."""
        return self.pp_size if self.ring_depth is None else self.ring_depth
