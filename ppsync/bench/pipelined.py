"""The pipelined benchmark, inside one rank: an engine-like loop that spins
``compute_us`` of simulated compute per step, for three token schemes:

- ``vllm``: vLLM's scheme (today's), on the CPU, synchronous: receivers run the tokens /
  counts / drafts broadcasts blocking at the start of each step (before the
  step's compute, where the engine needs them), the last rank after its
  compute (after sampling);
- ``ppsync_sync``: TokenPath with D = pp_size: receivers consume() the step
  posted D steps ago, then post() this step's receive, then compute; the last
  rank computes, then publish()es;
- ``ppsync_async``: the same through ``open_rank`` under anyio on asyncio,
  with a heartbeat task measuring the loop's lag.

With ``hidden``, each step also sends [rows, hidden] float32 to the next stage
and receives from the previous one on the world group (issued after the
compute, waited before the next compute).

Schemes cannot share a step (a ring keeps D transfers in flight), so the run
is split in rounds; each round runs every scheme for a chunk of steps, in an
order rotated per round, so slow phases of a loaded machine hit all alike.
Each chunk starts behind a barrier and drops its first steps as warm-up.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import anyio
import numpy as np
import torch.distributed as dist

from ppsync.bench.common import (
    Heartbeat,
    RankCtx,
    VllmBuffers,
    cpu_now,
    now,
    run_async,
    spin_ns,
    world_barrier,
)
from ppsync.bench.stats import overdue_within
from ppsync.bench.vllm_scheme import VllmHostOps
from ppsync.core.path.token_path import TokenPath
from ppsync.core.wire.transport import TransportClock
from ppsync.errors import PPSyncError
from ppsync.schemas.config import SyncConfig
from ppsync.services.runtime import open_rank

SCHEMES = ("vllm", "ppsync_sync", "ppsync_async")
MAX_ROUNDS = 4
MIN_CHUNK = 50


@dataclass
class Series:
    """One scheme on one group, on one rank: every round's measured steps."""

    step_ns: list[np.ndarray] = field(default_factory=list)  # [n] int64 per chunk
    blocked_ns: list[np.ndarray] = field(default_factory=list)  # [n] int64 per chunk
    complete: int = 0  # receiver steps whose head transfer was done before consume
    counted: int = 0  # receiver steps with a transfer at the head
    lag_ns: list[np.ndarray] = field(default_factory=list)  # lateness in token calls
    lag_raw_ns: list[np.ndarray] = field(default_factory=list)  # raw heartbeat lateness
    spans: list[tuple[int, int]] = field(default_factory=list)  # measured steps, per chunk
    cpu_ns: list[np.ndarray] = field(default_factory=list)  # vllm, ppsync_sync: own CPU per step


@dataclass(frozen=True, slots=True)
class PipelinedRankResult:
    series: dict[str, Series]
    """Keyed ``scheme@group``."""


def rounds(steps: int) -> tuple[int, int]:
    """(rounds, steps per chunk) for ``steps`` measured steps per scheme."""
    r = max(1, min(MAX_ROUNDS, steps // MIN_CHUNK))
    return r, max(1, steps // r)


@dataclass
class _Chunk:
    """One scheme's loop over ``warm + n`` steps; keeps the last n."""

    ctx: RankCtx
    group: dist.ProcessGroup
    config: SyncConfig
    clock: TransportClock
    warm: int
    n: int
    marks: np.ndarray = field(init=False)  # [warm + n + 1] int64 step starts, then the end
    blocked: np.ndarray = field(init=False)  # [warm + n] int64
    cpu: np.ndarray = field(init=False)  # [warm + n] int64 own CPU (ppsync_sync)
    windows: list[tuple[int, int]] = field(default_factory=list)  # token calls (async)
    complete: int = 0
    counted: int = 0
    hidden_works: list[dist.Work] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.marks = np.zeros(self.total + 1, dtype=np.int64)
        self.blocked = np.zeros(self.total, dtype=np.int64)
        self.cpu = np.zeros(self.total, dtype=np.int64)

    @property
    def total(self) -> int:
        return self.warm + self.n

    def compute(self) -> None:
        """Wait for the previous step's hidden states, compute, send this
        step's on (the compute is the engine's: it blocks on purpose)."""
        hidden = self.ctx.hidden
        if hidden is not None:
            hidden.wait(self.hidden_works)
        spin_ns(self.ctx.opts.compute_us * 1000)
        if hidden is not None:
            self.hidden_works = hidden.issue()

    def finish(self) -> None:
        self.marks[self.total] = now()
        if self.ctx.hidden is not None:
            self.ctx.hidden.wait(self.hidden_works)
            self.hidden_works = []

    def head_done(self, t: int, path: TokenPath) -> None:
        """Before consume at step t: was the head's transfer already done?"""
        if t >= self.warm and t >= self.config.depth:
            work = path.work_before_consume()
            self.counted += 1
            self.complete += work is None or work.is_completed()

    def check(self, kept: int, t: int) -> None:
        if t >= self.config.depth and kept != self.ctx.opts.rows:
            raise PPSyncError(f"bench rank {self.ctx.rank}: step {t} released {kept} rows, "
                              f"expected {self.ctx.opts.rows}")

    def store(self, into: Series) -> None:
        into.step_ns.append(np.diff(self.marks)[self.warm :])
        into.blocked_ns.append(self.blocked[self.warm :])
        into.cpu_ns.append(self.cpu[self.warm :])
        into.spans.append((int(self.marks[self.warm]), int(self.marks[self.total])))
        into.complete += self.complete
        into.counted += self.counted


def _vllm(c: _Chunk) -> None:
    """vLLM's scheme with its host calls (ppsync.bench.vllm_scheme); its own
    CPU per step is those calls' CPU, the broadcasts' excluded."""
    ctx = c.ctx
    ops = VllmHostOps(ctx.step)
    timeout_s = c.config.timeout_s
    for t in range(c.total):
        c.marks[t] = t0 = now()
        if not ctx.is_last:
            u0 = cpu_now()
            bufs = ops.receiver_before()
            b0 = cpu_now()
            VllmBuffers(bufs).blocking(ctx.src, c.group, timeout_s=timeout_s)
            b1 = cpu_now()
            ops.receiver_after(bufs)
            c.blocked[t] = now() - t0
            c.cpu[t] = cpu_now() - u0 - (b1 - b0)
        c.compute()
        if ctx.is_last:
            t1, u0 = now(), cpu_now()
            bufs = ops.last_before()
            b0 = cpu_now()
            VllmBuffers(bufs).blocking(ctx.src, c.group, timeout_s=timeout_s)
            c.blocked[t] = now() - t1
            c.cpu[t] = b0 - u0
    c.finish()


def _ppsync_sync(c: _Chunk) -> None:
    ctx, s = c.ctx, c.ctx.step
    path = TokenPath(c.config, c.group)
    clock = path.clock = c.clock
    for t in range(c.total):
        c.marks[t] = t0 = now()
        if not ctx.is_last:
            c.head_done(t, path)
            u0, k0 = cpu_now(), clock.total()
            released = path.consume()
            path.post(s.view)
            c.blocked[t] = now() - t0
            c.cpu[t] = cpu_now() - u0 - (clock.total() - k0)
            c.check(0 if released is None else released.num_kept, t)
        c.compute()
        if ctx.is_last:
            t1, u0, k0 = now(), cpu_now(), clock.total()
            path.publish(s.view, s.sampled())
            c.blocked[t] = now() - t1
            c.cpu[t] = cpu_now() - u0 - (clock.total() - k0)
    c.finish()
    path.close()  # waits (bounded) for the last D transfers on every rank


async def _ppsync_async(c: _Chunk, beat: Heartbeat) -> None:
    ctx, s = c.ctx, c.ctx.step
    async with open_rank(c.config, c.group) as rank, anyio.create_task_group() as tg:
        rank.path.clock = c.clock
        await tg.start(beat.run)
        for t in range(c.total):
            c.marks[t] = t0 = now()
            if not ctx.is_last:
                c.head_done(t, rank.path)
                released = await rank.take()
                await rank.post(s.view)
                t1 = now()
                c.blocked[t] = t1 - t0
                c.windows.append((t0, t1))
                c.check(0 if released is None else released.num_kept, t)
            c.compute()
            if ctx.is_last:
                t1 = now()
                await rank.publish(s.view, s.sampled())
                t2 = now()
                c.blocked[t] = t2 - t1
                c.windows.append((t1, t2))
        c.finish()
        tg.cancel_scope.cancel()


def _run_chunk(scheme: str, c: _Chunk, into: Series) -> None:
    if scheme == "vllm":
        _vllm(c)
    elif scheme == "ppsync_sync":
        _ppsync_sync(c)
    else:
        beat = Heartbeat()

        async def main(_: RankCtx) -> None:
            await _ppsync_async(c, beat)

        run_async(main, c.ctx)
        since = int(c.marks[c.warm])
        due, woke = beat.arrays(since_ns=since)
        win = np.array([w for w in c.windows if w[0] >= since], dtype=np.int64).reshape(-1, 2)
        into.lag_ns.append(overdue_within(due, woke, win[:, 0], win[:, 1]))
        into.lag_raw_ns.append(np.maximum(woke - due, 0))
    c.store(into)


def pipelined_rank(ctx: RankCtx) -> PipelinedRankResult:
    """This rank's part of the pipelined benchmark."""
    o = ctx.opts
    config = o.sync_config(ring_depth=o.pp_size)
    n_rounds, n = rounds(o.pipelined_iters)
    warm = max(2 * config.depth, o.warmup // n_rounds)
    runs = [(scheme, name, group) for name, group in ctx.groups for scheme in SCHEMES]
    out = {f"{scheme}@{name}": Series() for scheme, name, _ in runs}
    clock = TransportClock()
    for r in range(n_rounds):
        for j in range(len(runs)):
            scheme, name, group = runs[(r + j) % len(runs)]  # the same on every rank
            world_barrier(timeout_s=o.timeout_s)
            chunk = _Chunk(ctx, group, config, clock, warm, n)
            _run_chunk(scheme, chunk, out[f"{scheme}@{name}"])
    return PipelinedRankResult(out)
