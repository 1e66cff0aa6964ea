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
CarrierName = Literal["host", "device"]
"""How the device codec's frames travel (ppsync.core.wire.backends.CARRIERS)."""
CpuKernelsName = Literal["auto", "numba", "numpy"]
DeviceKernelsName = Literal["auto", "triton", "torch"]
EmulatedName = Literal["nccl", "xccl"]
"""The backends whose completion semantics the CPU twin emulates (``--emulate``)."""



def frames_on_device(codec: str) -> bool:
    """Whether frames of the codec named ``codec`` live on the engine's
    device (the device codec) rather than on the host: decided here only
    (no torch, so the command's parser asks it too); a codec object says the
    same as ``on_device``."""
    return codec == "device"


RENAMED_FIELDS = {"host_kernels": "cpu_kernels"}
"""SyncConfig's old field names, each refused naming its new one: no alias,
as no release has shipped under the old name."""

DEFAULT_TIMEOUT_S = 300.0
"""The bound on one wait for a live peer when none is given (SyncConfig's,
the plugins' and the ``ppsync`` command's ``--timeout``): of the order of
the engines' own (vLLM's ``VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS`` is 300 s),
since a live peer may be slow for that long (a JIT compile, a long prefill)."""
DEFAULT_SILENT_S = 15.0
"""How long a peer's heartbeat may stop before it is named silent, when
none is given (docs/design.md, "Slow is not dead", says why this value)."""
DEFAULT_MAX_PENDING_S = 86400.0
"""The longest a transfer may stay pending from its post, when none is
given: a hard cap ppsync enforces itself, so that the backend's own clock
(gloo's group timeout, NCCL's watchdog), set above it, never speaks first."""


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
    """Bound on one wait for a live peer (a consume, a drain, a send that
    waits, the handshake), counted from when that wait began, never from a
    post: a peer that is alive but slow gets this long. A rank-local
    setting: ranks need not agree."""
    silent_s: float = Field(default=DEFAULT_SILENT_S, ge=2, le=3600)
    """How long a peer's heartbeat (about one a second, through the failure
    board) may stop before every rank that waits on it names it silent,
    whatever the step time. A rank-local setting."""
    max_pending_s: float = Field(default=DEFAULT_MAX_PENDING_S, gt=0, le=7 * 86400)
    """The longest a transfer may stay pending from its post (a hard cap,
    far above any healthy pipeline's latency); the token group's own
    timeout is set above it, so ppsync speaks before the backend. At least
    timeout_s. A rank-local setting."""
    wire: WireMode = "fixed"
    """'fixed': frames sized for max_num_reqs rows (mismatched num_reqs cannot
    deadlock); 'exact': frames sized for num_reqs rows (fewer bytes)."""
    codec: CodecName = "host"
    """'host': frames packed and checked with numpy on the host (the CPU
    default); 'device': with torch ops where the tensors live, checks
    deferred by one step (what a GPU needs: no host sync per step). Every
    rank must use the same codec (the handshake compares it)."""
    carrier: CarrierName = "host"
    """How the device codec's frames travel between ranks: 'host' (the
    default: packed and checked on the device, copied to pinned host memory
    without blocking, over gloo, copied back at consume: no kernel of the
    device waits on a peer) or 'device' (the device's own backend, NCCL or
    XCCL, on a side stream). The host codec's frames are host frames either
    way. Every rank must use the same (the handshake compares it)."""
    cpu_kernels: CpuKernelsName = "auto"
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

    @model_validator(mode="before")
    @classmethod
    def _no_old_names(cls, data: object) -> object:
        if isinstance(data, dict):
            for old, new in RENAMED_FIELDS.items():
                if old in data:
                    raise ValueError(f"{old} is now {new}")
        return data

    @model_validator(mode="after")
    def _depth_within_pp_size(self) -> SyncConfig:
        if self.ring_depth is not None and self.ring_depth > self.pp_size:
            raise ValueError(
                f"ring_depth = {self.ring_depth} exceeds pp_size = {self.pp_size}; "
                "allowed 1..pp_size"
            )
        return self

    @model_validator(mode="after")
    def _cap_above_timeout(self) -> SyncConfig:
        if self.max_pending_s < self.timeout_s:
            raise ValueError(
                f"max_pending_s = {self.max_pending_s:g} is below timeout_s = "
                f"{self.timeout_s:g}; a transfer's cap must allow a whole wait")
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
