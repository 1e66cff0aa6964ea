"""The run report that ``ppsync launch`` and ``ppsync run`` print and write as JSON."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from ppsync.schemas.config import SyncConfig


class RankReport(BaseModel):
    """What one rank did and saw during a run."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    rank: int = Field(ge=0)
    """Rank within its PP group."""
    global_rank: int | None = Field(default=None, ge=0)
    """World rank (None in reports made before a world was gathered)."""
    pp_group: int = Field(default=0, ge=0)
    """Index of its PP group in the tensor x pipeline layout (0 when there is one)."""
    role: Literal["last", "receiver"]
    """'last' samples and broadcasts; 'receiver' posts and consumes."""
    steps: int = Field(ge=0)
    """Engine steps run."""
    transfers: int = Field(ge=0)
    """Steps that had a transfer (at least one row needed a sample)."""
    rows_sent: int = Field(default=0, ge=0)
    """Rows needing a sample that the last rank broadcast."""
    rows_expected: int = Field(default=0, ge=0)
    """Rows this receiver should have been handed (needed and still live)."""
    excluded: int = Field(default=0, ge=0)
    """Rows the last rank sent that this receiver had to drop: their request
    slot was freed (its generation changed) between the receive's post and its
    consume. In a clean run, last rank's rows_sent = rows_delivered + excluded
    on every receiver."""
    rows_delivered: int = Field(default=0, ge=0)
    """Rows handed to the engine whose tokens matched the workload exactly."""
    lost: int = Field(default=0, ge=0)
    """Expected rows that were not handed out."""
    stale: int = Field(default=0, ge=0)
    """Rows handed out for a request that had ended (or needed no sample)."""
    duplicated: int = Field(default=0, ge=0)
    """Rows handed out for a (request, position) already delivered."""
    corrupt: int = Field(default=0, ge=0)
    """Rows handed out with tokens, counts or drafts that differ from the workload."""
    sync_us_p50: float = Field(default=0.0, ge=0)
    """Median time per step this rank's loop spent blocked in the token path (µs)."""
    sync_us_p99: float = Field(default=0.0, ge=0)
    """99th percentile of the same (µs)."""
    wall_s: float = Field(default=0.0, ge=0)
    """Wall time of the rank's step loop."""
    rss_start_mb: float = Field(default=0.0, ge=0)
    """Resident memory of the rank process when its loop started (MiB)."""
    rss_end_mb: float = Field(default=0.0, ge=0)
    """Resident memory of the rank process when its loop ended (MiB)."""
    completion: str = "host-completed"
    """What the token group's works meant: "host-completed" (gloo),
    "stream-ordered" (NCCL, XCCL), or the CPU twin of the latter (--emulate)."""
    engine_waits_unconsumed: int | None = Field(default=None, ge=0)
    """CPU twin only (else None): times the engine's stream was made to wait
    on a frame's transfer before its consume, or on a broadcast. Must be 0."""
    engine_waits_consumed: int | None = Field(default=None, ge=0)
    """CPU twin only: the engine's stream's waits on received frames at their
    consume (the expected ones)."""
    copy_waits: int | None = Field(default=None, ge=0)
    """The host carrier only (else None): times a thread waited for a frame's
    copy to pinned memory before it could send it (a drain at close waits
    for the copies uncounted). Must be 0: the engine never waits on a copy."""
    pinned_reused_early: int | None = Field(default=None, ge=0)
    """The host carrier only: pinned buffers taken again before the copy that
    last used them ended. Must be 0."""
    cpu_kernels: str | None = None
    """The CPU kernel set this rank resolved ("numba", "numpy"; None: not known)."""
    device_kernels: str | None = None
    """The device kernel set this rank resolved ("triton", "torch"; None: the
    host codec, or not known)."""

    @property
    def faults(self) -> int:
        """Rows lost, stale, duplicated or corrupt, plus the twin's engine-stream
        waits on unconsumed transfers and the host carrier's pinned buffers
        reused early and waits on a copy (broken promises, though no row was)."""
        return (self.lost + self.stale + self.duplicated + self.corrupt
                + (self.engine_waits_unconsumed or 0) + (self.pinned_reused_early or 0)
                + (self.copy_waits or 0))


class RunReport(BaseModel):
    """One run of the synthetic workload over every rank."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    config: SyncConfig
    """The token path's configuration."""
    steps: int = Field(ge=0)
    """Steps each rank ran."""
    seed: int
    """Workload seed."""
    mode: Literal["sync", "async"] = "sync"
    """Which path carried the tokens: the synchronous core or the anyio services."""
    world_size: int | None = Field(default=None, ge=1)
    """Ranks in the world: pp_size times the number of PP groups (None: pp_size)."""
    ranks: list[RankReport]
    """One entry per world rank, in world rank order."""
    framework: Literal["asyncio", "trio"] | None = None
    """The async framework of mode "async" (None: the synchronous core)."""
    emulate: str | None = None
    """The backend whose completion semantics the token groups emulated
    (``--emulate``, the CPU twin; None: their own)."""
    ended: str | None = None
    """Why the run ended before its last step (a rank failed, made no
    progress, the launcher was stopped); None: it ran to its end. The
    ranks' figures are then what was checked up to that moment."""

    @property
    def ok(self) -> bool:
        """True when the run ran to its end and no rank lost, duplicated,
        corrupted or kept a stale row (and, on the CPU twin, no engine stream
        waited on an unconsumed transfer)."""
        return self.ended is None and all(r.faults == 0 for r in self.ranks)
