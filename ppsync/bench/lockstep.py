"""The lockstep benchmark, inside one rank: each iteration runs every variant
once, each waiting for its own transfer, in a round-robin order that every
rank derives from the iteration number (so all ranks issue the same
collectives in the same order):

- ``a_raw_frame``: one raw broadcast of a frame's words (the floor);
- ``b_vllm``: today's scheme, tokens / counts / drafts in 2-3 broadcasts,
  issued back to back and then waited;
- ``c_ppsync_sync``: TokenPath with ring depth 1: the last rank publish()es
  (and waits for the send, as a broadcast root does), receivers post() then
  consume() the step they just posted;
- ``d_ppsync_async``: the same through ``open_rank`` under anyio on asyncio.

After ``warmup`` back-to-back iterations the ranks agree on a time slot
(twice the slowest variant's p75 plus 0.2 ms, shrunk if the run would pass
75 s) and a start instant; variant j of
iteration i then starts at ``t0 + (i * V + j) * slot`` on every rank, so each
variant starts from a quiet group with every rank in at once, and a variant's
span (first rank in, last rank out) carries no skew left by the one before.

The variants a, b, c and the waits between slots block the event loop on
purpose; a heartbeat task measures the loop's lag, and only lateness that
falls inside d's calls is counted against ppsync.
"""

from __future__ import annotations

from contextlib import AsyncExitStack
from dataclasses import dataclass

import anyio
import numpy as np
import torch
import torch.distributed as dist

from ppsync.bench.common import (
    Heartbeat,
    RankCtx,
    VllmBuffers,
    cpu_now,
    now,
    run_async,
    wait_all,
    wait_until,
    world_max,
    world_start,
)
from ppsync.bench.stats import overdue_within
from ppsync.core.frame import FrameView
from ppsync.core.frame.numpy_frames import NumpyFrames
from ppsync.core.path.token_path import TokenPath
from ppsync.core.wire.transport import TransportClock, broadcast_async, wait_work
from ppsync.errors import PPSyncError
from ppsync.services.awaiting import await_work
from ppsync.services.runtime import Rank, open_rank

VARIANTS = ("a_raw_frame", "b_vllm", "c_ppsync_sync", "d_ppsync_async")
MIN_SLOT_NS = 500_000
MAX_RUN_NS = 75_000_000_000  # the slots of a whole run: past this they shrink
START_LEAD_NS = 50_000_000


@dataclass(frozen=True, slots=True)
class LockstepRankResult:
    """One rank's lockstep samples; column k of t_in / t_out is
    (variant k % 4, group k // 4)."""

    t_in: np.ndarray  # [iters, V] int64 perf_counter_ns
    t_out: np.ndarray  # [iters, V] int64
    cpu_ns: np.ndarray  # [iters] int64: ppsync's own CPU in c, dedicated group
    lag_ns: np.ndarray  # [n] int64: heartbeat lateness inside d's calls
    slot_ns: int


@dataclass(slots=True)
class _Lane:
    """Everything the variants need on one group."""

    group: dist.ProcessGroup
    path: TokenPath  # variant c
    rank: Rank  # variant d


class _Lockstep:
    def __init__(self, ctx: RankCtx, clock: TransportClock) -> None:
        o = ctx.opts
        self.ctx = ctx
        self.clock = clock
        self.config = o.sync_config(ring_depth=1)
        codec = NumpyFrames(self.config)
        self.frame = torch.zeros(codec.words(o.rows), dtype=torch.int64)  # [words]
        if ctx.is_last:  # a real frame, though a raw broadcast never looks
            s = ctx.step
            codec.pack(self.frame.numpy(), FrameView(0, o.rows, 0), s.tokens.numpy(),
                       s.num_sampled.numpy(), s.num_rejected.numpy(),
                       None if s.drafts is None else s.drafts.numpy())
        self.vllm = VllmBuffers.of(ctx.step, is_last=ctx.is_last)
        self.lanes: list[_Lane] = []

    @property
    def width(self) -> int:
        return len(VARIANTS) * len(self.lanes)

    def _what(self, variant: str) -> str:
        return f"bench rank {self.ctx.rank}: {variant}"

    async def one(self, k: int) -> int | None:
        """Run column k once; return ppsync's own CPU (ns) when k is c on
        the dedicated group, else None."""
        lane = self.lanes[k // len(VARIANTS)]
        v = k % len(VARIANTS)
        ctx, timeout_s = self.ctx, self.config.timeout_s
        if v == 0:
            wait_work(broadcast_async(self.frame, ctx.src, lane.group),
                      timeout_s=timeout_s, what=self._what("a"), peer=ctx.src)
        elif v == 1:
            wait_all(self.vllm.issue(ctx.src, lane.group), timeout_s=timeout_s,
                     what=self._what("b"))
        elif v == 2:
            cpu = self._sync_step(lane.path)
            return cpu if k == 2 else None
        else:
            await self._async_step(lane.rank)
        return None

    def _sync_step(self, path: TokenPath) -> int:
        """Variant c; returns ppsync's own CPU time (this thread's, less the
        collective's issue and waits)."""
        s = self.ctx.step
        t0, c0 = cpu_now(), self.clock.total()
        if self.ctx.is_last:
            path.publish(s.view, s.sampled())
            cpu = cpu_now() - t0 - (self.clock.total() - c0)
            issued = path.last_issued()
            assert issued is not None
            wait_work(issued[1], timeout_s=self.config.timeout_s,
                      what=self._what("c send"), peer=None)
            return cpu
        path.post(s.view)
        released = path.consume()
        cpu = cpu_now() - t0 - (self.clock.total() - c0)
        self._check(0 if released is None else released.num_kept, "c")
        return cpu

    async def _async_step(self, rank: Rank) -> None:
        s = self.ctx.step
        if self.ctx.is_last:
            await rank.publish(s.view, s.sampled())
            issued = rank.path.last_issued()
            assert issued is not None
            await await_work(issued[1], timeout_s=self.config.timeout_s,
                             what=self._what("d send"), completion=rank.path.completion)
            return
        await rank.post(s.view)
        released = await rank.take()
        self._check(0 if released is None else released.num_kept, "d")

    def _check(self, kept: int, variant: str) -> None:
        if kept != self.ctx.opts.rows:
            raise PPSyncError(f"{self._what(variant)}: released {kept} rows, "
                              f"expected {self.ctx.opts.rows}")

    async def _iteration(self, i: int, base_ns: int | None, slot_ns: int,
                         t_in: np.ndarray, t_out: np.ndarray, t_end: np.ndarray,
                         cpu: np.ndarray) -> None:
        """Iteration i: every column once. t_out is when the token traffic
        finished; t_end when the column's hidden-state traffic did too."""
        hidden = self.ctx.hidden
        V = self.width
        for j in range(V):
            k = (i + j) % V  # the same order on every rank
            if base_ns is not None:
                wait_until(base_ns + (i * V + j) * slot_ns)
            works = hidden.issue() if hidden is not None else []
            t_in[i, k] = now()
            own = await self.one(k)
            t_out[i, k] = now()
            if hidden is not None:
                hidden.wait(works)
            t_end[i, k] = now()
            if own is not None:
                cpu[i] = own

    async def run(self) -> LockstepRankResult:
        ctx, o = self.ctx, self.ctx.opts
        async with AsyncExitStack() as stack:
            for _, group in ctx.groups:
                rank = await stack.enter_async_context(open_rank(self.config, group))
                path = TokenPath(self.config, group)
                path.clock = rank.path.clock = self.clock
                self.lanes.append(_Lane(group, path, rank))
            if not ctx.is_last:  # open each ring's tail: every step is post, then consume
                for lane in self.lanes:
                    lane.path.consume()
                    await lane.rank.take()
            beat = Heartbeat()
            tg = await stack.enter_async_context(anyio.create_task_group())
            await tg.start(beat.run)
            V = self.width
            w_in, w_out, w_end = (np.zeros((o.warmup, V), dtype=np.int64) for _ in range(3))
            w_cpu = np.zeros(o.warmup, dtype=np.int64)
            for i in range(o.warmup):
                await self._iteration(i, None, 0, w_in, w_out, w_end, w_cpu)
            slot_ns = world_max(self._slot_proposal(w_end - w_in), timeout_s=self.config.timeout_s)
            # a loaded machine inflates the slot; keep the run bounded (a slot
            # shorter than a variant only makes the next one start late)
            slot_ns = max(MIN_SLOT_NS, min(slot_ns, MAX_RUN_NS // (o.iters * V)))
            base_ns = world_start(START_LEAD_NS, timeout_s=self.config.timeout_s)
            t_in, t_out, t_end = (np.zeros((o.iters, V), dtype=np.int64) for _ in range(3))
            cpu = np.zeros(o.iters, dtype=np.int64)
            for i in range(o.iters):
                await self._iteration(i, base_ns, slot_ns, t_in, t_out, t_end, cpu)
            tg.cancel_scope.cancel()
            for lane in self.lanes:
                lane.path.close()
        due, woke = beat.arrays(since_ns=base_ns)
        d_cols = [k for k in range(V) if k % len(VARIANTS) == 3]
        starts, ends = t_in[:, d_cols].ravel(), t_out[:, d_cols].ravel()
        order = np.argsort(starts)
        lag = overdue_within(due, woke, starts[order], ends[order])
        return LockstepRankResult(t_in, t_out, cpu, lag, slot_ns)

    def _slot_proposal(self, windows_ns: np.ndarray) -> int:
        """A slot that fits twice the slowest column's p75, plus 0.2 ms."""
        if windows_ns.shape[0] == 0:
            return 4 * MIN_SLOT_NS
        p75 = np.percentile(windows_ns, 75, axis=0)
        return max(MIN_SLOT_NS, int(2 * p75.max()) + 200_000)


async def _lockstep(ctx: RankCtx) -> LockstepRankResult:
    return await _Lockstep(ctx, TransportClock()).run()


def lockstep_rank(ctx: RankCtx) -> LockstepRankResult:
    """This rank's part of the lockstep benchmark."""
    return run_async(_lockstep, ctx)
