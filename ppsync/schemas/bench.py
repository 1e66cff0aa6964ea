"""What ``ppsync bench`` is asked to do and what it reports.

Units: every ``*_us`` field is microseconds. The arithmetic that produces
these figures lives with the benchmarks.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ppsync.errors import ConfigError
from ppsync.schemas._validate import validate_as
from ppsync.schemas.config import SyncConfig


class BenchOptions(BaseModel):
    """One ``ppsync bench`` run."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    pp_size: int = Field(default=2, ge=2, le=64)
    """Ranks P (at least one receiver)."""
    rows: int = Field(default=256, ge=1, le=1 << 16)
    """Decode rows per step, every one needing a sample."""
    spec: int = Field(default=0, ge=0, le=64)
    """K: speculative steps (drafts per row); L = K + 1."""
    iters: int = Field(default=2000, ge=1)
    """Lockstep iterations (each runs every variant once)."""
    pipelined_iters: int = Field(default=1000, ge=1)
    """Measured steps per pipelined variant."""
    compute_us: int = Field(default=400, ge=0, le=1_000_000)
    """Simulated compute per pipelined step (busy-wait), µs."""
    warmup: int = Field(default=100, ge=0)
    """Lockstep iterations before measuring (also size the time slots);
    pipelined steps dropped at the start of the run, spread over its rounds."""
    hidden: tuple[int, int] | None = None
    """(rows, hidden): concurrent [rows, hidden] float32 send/recv between
    adjacent stages on the world group, and every variant run twice, on the
    dedicated token group and on the world group."""
    max_num_reqs: int | None = Field(default=None, ge=1)
    """Request slots (the fixed frame's row count); None = rows."""
    timeout_s: float = Field(default=30.0, gt=0, le=3600)
    """Bound on every wait."""

    @model_validator(mode="after")
    def _fits(self) -> BenchOptions:
        if self.max_num_reqs is not None and self.max_num_reqs < self.rows:
            raise ValueError(f"max_num_reqs = {self.max_num_reqs} must be >= rows = {self.rows}")
        if self.hidden is not None and min(self.hidden) < 1:
            raise ValueError(f"hidden = {self.hidden}: both sizes must be >= 1")
        return self

    @classmethod
    def build(cls, **fields: object) -> BenchOptions:
        """Validate ``fields``; raise :class:`ConfigError` naming each bad one."""
        return validate_as(cls, fields, ConfigError)

    def sync_config(self, *, ring_depth: int) -> SyncConfig:
        return SyncConfig.build(
            pp_size=self.pp_size,
            max_num_reqs=self.max_num_reqs or self.rows,
            num_speculative_steps=self.spec,
            ring_depth=ring_depth,
            timeout_s=self.timeout_s,
        )

    @property
    def group_names(self) -> tuple[str, ...]:
        """Groups the token traffic runs on: the dedicated one, and with
        ``hidden`` the world group as well."""
        return ("dedicated", "world") if self.hidden else ("dedicated",)


class LockstepStats(BaseModel):
    """One lockstep variant on one group: every rank enters at the same
    instant (a shared time slot) and the step ends when every rank is out."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    variant: str
    """a_raw_frame, b_vllm, c_ppsync_sync or d_ppsync_async."""
    group: str
    """'dedicated' (the token group) or 'world'."""
    span_p50_us: float
    """Median of max(rank out) - min(rank in), per iteration."""
    span_p99_us: float
    """99th percentile of the same."""
    last_p50_us: float
    """Median time the last rank spent in the step."""
    receiver_p50_us: float
    """Median time a receiver spent in the step (the slowest receiver's)."""


class PipelinedStats(BaseModel):
    """One pipelined scheme on one group: an engine-like loop per rank."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    variant: str
    """vllm (vLLM's scheme: blocking broadcasts each step), ppsync_sync or ppsync_async."""
    group: str
    """'dedicated' or 'world'."""
    step_p50_us: float
    """Median step wall time (the slowest rank's median)."""
    step_mean_us: float
    """Loop wall time / steps (the slowest rank's): the throughput figure."""
    blocked_p50_us: float
    """Median time per step a rank's loop spent in the token path (slowest rank)."""
    blocked_mean_us: float
    """Mean of the same (slowest rank)."""
    blocked_last_p50_us: float
    """Median blocked time of the last rank."""
    blocked_receiver_p50_us: float
    """Median blocked time of the slowest receiver."""
    complete_at_consume: float | None = None
    """ppsync only: fraction of receiver steps whose head transfer had
    completed (or needed no wait) before consume was called."""
    lag_p99_us: float | None = None
    """ppsync_async only: p99 of event-loop lag outside the simulated compute."""
    lag_raw_p99_us: float | None = None
    """ppsync_async only: p99 of raw heartbeat lag (includes the compute)."""


class CpuStats(BaseModel):
    """ppsync's own CPU per step: everything but the collective, as the
    calling thread's CPU time (time.thread_time_ns), so a busy machine taking
    the core away mid-call does not count."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    last_inrun_p50_us: float
    """Last rank, variant c: publish() CPU time minus the broadcast issue's."""
    receiver_inrun_p50_us: float
    """A receiver, variant c: post() + consume() CPU time minus the receive's
    issue and the wait on a transfer that had not completed."""
    last_pipelined_p50_us: float
    """Last rank, ppsync_sync in the pipelined loop (dedicated group): the
    same measure between compute spins."""
    receiver_pipelined_p50_us: float
    """A receiver, ppsync_sync in the pipelined loop: consume() + post()."""
    last_micro_p50_us: float
    """Hot loop on the real TokenPath (host codec; a last rank's and a
    receiver's path in one process, frames over a loopback, no compute
    between steps): publish() CPU time minus the issue and waits, the median
    of the quietest block of steps (the figure the target is checked
    against: the code's own cost)."""
    receiver_micro_p50_us: float
    """The same hot loop, the receiver: consume() + post() CPU time minus
    the issue and waits."""
    vllm_last_pipelined_p50_us: float = 0.0
    """vLLM's scheme in the same pipelined loop, last rank: its host
    calls (ppsync.bench.vllm_scheme) CPU time, its broadcasts excluded."""
    vllm_receiver_pipelined_p50_us: float = 0.0
    """The same, a receiver."""
    vllm_last_micro_p50_us: float = 0.0
    """vLLM's scheme's last-rank host calls in the hot loop, timed
    between ppsync's steps (the same quietest-block median)."""
    vllm_receiver_micro_p50_us: float = 0.0
    """The same, a receiver's host calls."""
    recorder_last_us: float = 0.0
    """Single process: the flight recorder's calls per last-rank step
    (issue + complete), recorder on (SyncConfig's default flight_events)."""
    recorder_last_off_us: float = 0.0
    """The same calls with the recorder off (flight_events = 0)."""
    recorder_receiver_us: float = 0.0
    """Single process: the flight recorder's calls per receiver step
    (consume + issue), recorder on."""
    recorder_receiver_off_us: float = 0.0
    """The same calls with the recorder off."""


class Target(BaseModel):
    """One figure against the issue's target (reported, never asserted)."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    name: str
    value: float
    limit: float
    met: bool


class BenchReport(BaseModel):
    """Everything ``ppsync bench`` measured."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    options: BenchOptions
    frame_words: int
    """int64 words of ppsync's frame (what variant a broadcasts)."""
    slot_us: float
    """Lockstep time slot: every variant of every iteration starts at
    t0 + k * slot on every rank."""
    lockstep: list[LockstepStats]
    lockstep_lag_p99_us: float
    """Variant d: p99 of event-loop lag while d's calls ran (lag that fell
    inside the benchmark's own blocking variants is not counted)."""
    dispatches: dict[str, dict[str, dict[str, float]]] = Field(default_factory=dict)
    """Per step, per role, for this run's rows and K: {scheme: {role:
    {dispatches, launches, collectives, host_syncs}}} (ppsync.bench.dispatches)."""
    idle_lag_p99_us: float = 0.0
    """p99 of the raw lateness of the same 1 ms heartbeat on an event loop
    that runs nothing else (a thread of the bench's waiting parent process),
    over the samples due while the pipelined ppsync_async chunks ran: this
    machine's scheduler stalls, which ppsync_async's lag_p99_us is compared
    with (the target is the difference)."""
    pipelined: list[PipelinedStats]
    cpu: CpuStats
    ratios: dict[str, float]
    """Lockstep on span medians, pipelined on step and blocked medians."""
    targets: list[Target]
    reference_config: bool
    """True when run at the targets' configuration (P=2, 256 rows, K=0 or 3,
    C=400 µs, no hidden): only then are the targets printed."""
    wall_s: float
    """Wall time of the whole bench."""
