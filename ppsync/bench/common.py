"""Pieces shared by the lockstep and pipelined benchmarks, inside one rank
process: the fixed batch, vLLM's scheme's broadcasts, timing helpers, the
hidden-state traffic, the event-loop heartbeat, and the world-group
collectives that align ranks. Every wait is bounded by ``timeout_s``.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TypeVar

import anyio
import numpy as np
import torch
import torch.distributed as dist
from anyio.abc import TaskStatus

from ppsync.core.frame.rows import SampledStep
from ppsync.core.rules import BatchView
from ppsync.core.wire.groups import token_group
from ppsync.core.wire.transport import broadcast_async, wait_work
from ppsync.schemas.bench import BenchOptions

now = time.perf_counter_ns  # CLOCK_MONOTONIC: one clock for every rank process
cpu_now = time.thread_time_ns  # this thread's CPU time: immune to preemption on a busy machine


def spin_ns(ns: int) -> None:
    """Busy-wait ``ns`` (simulated compute: the core stays busy)."""
    end = now() + ns
    while now() < end:
        pass


def wait_until(t_ns: int) -> None:
    """Sleep, then spin the last 0.2 ms, until perf_counter_ns() >= t_ns."""
    left = t_ns - now()
    if left > 400_000:
        time.sleep((left - 200_000) / 1e9)
    while now() < t_ns:
        pass


def world_group() -> dist.ProcessGroup:
    group = dist.group.WORLD
    assert isinstance(group, dist.ProcessGroup)  # spawn_ranks initialized it
    return group


def wait_all(works: list[dist.Work], *, timeout_s: float, what: str) -> None:
    for w in works:
        wait_work(w, timeout_s=timeout_s, what=what, peer=None)


def world_max(value: int, *, timeout_s: float) -> int:
    """The largest ``value`` over every world rank."""
    t = torch.tensor([value], dtype=torch.int64)
    work = dist.all_reduce(t, op=dist.ReduceOp.MAX, group=world_group(), async_op=True)
    assert work is not None
    wait_work(work, timeout_s=timeout_s, what="bench: all_reduce", peer=None)
    return int(t.item())


def world_start(lead_ns: int, *, timeout_s: float) -> int:
    """A start instant agreed by every rank: world rank 0's clock + lead."""
    t = torch.tensor([now() + lead_ns], dtype=torch.int64)
    work = broadcast_async(t, 0, world_group())
    wait_work(work, timeout_s=timeout_s, what="bench: start broadcast", peer=0)
    return int(t.item())


def world_barrier(*, timeout_s: float) -> None:
    world_max(0, timeout_s=timeout_s)


# -- the fixed step -----------------------------------------------------------


@dataclass(frozen=True, slots=True)
class FixedStep:
    """One decode step of ``rows`` rows, every row needing a sample; the same
    batch every step (nothing is freed, so every row is always kept)."""

    view: BatchView
    tokens: torch.Tensor  # [rows, L] int64
    num_sampled: torch.Tensor  # [rows] int32, in [1, L]
    num_rejected: torch.Tensor  # [rows] int32, L - num_sampled
    drafts: torch.Tensor | None  # [rows, K] int64; None when K = 0
    counts: torch.Tensor  # [2 * rows] int32: num_sampled then num_rejected (vLLM's scheme)

    def to(self, device: torch.device) -> FixedStep:
        """The same step with its tensors on ``device``."""
        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device)
        tokens, ns, nr, counts = (t.to(device) for t in (self.tokens, self.num_sampled,
                                                         self.num_rejected, self.counts))
        return FixedStep(self.view, tokens, ns, nr, move(self.drafts), counts)

    def sampled(self) -> SampledStep:
        """The step's sampled rows as an engine hands them to publish: a
        record built per step, at the edge, as an engine builds it."""
        return SampledStep(self.tokens, self.num_sampled, self.num_rejected, self.drafts)


def fixed_step(rows: int, num_drafts: int, *, seed: int = 0) -> FixedStep:
    rng = np.random.default_rng(seed)
    L = num_drafts + 1
    prefill_np = np.full(rows, 16, dtype=np.int64)  # [rows]
    view = BatchView(
        num_reqs=rows,
        idx_mapping_np=np.arange(rows, dtype=np.int64),
        num_computed_tokens_np=prefill_np + 5,
        num_scheduled_tokens_np=np.full(rows, 1 + num_drafts, dtype=np.int64),
        prefill_len_np=prefill_np,
    )
    ns = rng.integers(1, L + 1, size=rows).astype(np.int32)
    return FixedStep(
        view=view,
        tokens=torch.from_numpy(rng.integers(0, 32000, size=(rows, L), dtype=np.int64)),
        num_sampled=torch.from_numpy(ns),
        num_rejected=torch.from_numpy((L - ns).astype(np.int32)),
        drafts=torch.from_numpy(rng.integers(0, 32000, size=(rows, num_drafts),
                                             dtype=np.int64)) if num_drafts else None,
        counts=torch.from_numpy(np.concatenate([ns, L - ns]).astype(np.int32)),
    )


@dataclass(frozen=True, slots=True)
class VllmBuffers:
    """Today's scheme: tokens, counts, drafts each in its own broadcast."""

    tensors: tuple[torch.Tensor, ...]

    @classmethod
    def of(cls, step: FixedStep, *, is_last: bool) -> VllmBuffers:
        own = (step.tokens, step.counts) + ((step.drafts,) if step.drafts is not None else ())
        if is_last:
            return cls(own)
        return cls(tuple(torch.empty_like(t) for t in own))

    def issue(self, src: int, group: dist.ProcessGroup) -> list[dist.Work]:
        return [broadcast_async(t, src, group) for t in self.tensors]

    def blocking(self, src: int, group: dist.ProcessGroup, *, timeout_s: float) -> None:
        """One broadcast after the other, each waited before the next."""
        for t in self.tensors:
            wait_work(broadcast_async(t, src, group), timeout_s=timeout_s,
                      what="bench: vLLM's scheme broadcast", peer=src)


# -- hidden-state traffic -----------------------------------------------------


class HiddenLink:
    """[rows, hidden] float32 from each stage to the next, on the world group,
    issued asynchronously (what a PP engine sends between stages)."""

    def __init__(self, shape: tuple[int, int], *, rank: int, pp_size: int,
                 timeout_s: float) -> None:
        self.rank = rank
        self.pp_size = pp_size
        self.timeout_s = timeout_s
        self.send_buf = torch.ones(shape, dtype=torch.float32)  # [rows, hidden]
        self.recv_buf = torch.empty(shape, dtype=torch.float32)  # [rows, hidden]

    def issue(self) -> list[dist.Work]:
        works: list[dist.Work | None] = []
        if self.rank + 1 < self.pp_size:
            works.append(dist.isend(self.send_buf, self.rank + 1, group=world_group()))
        if self.rank > 0:
            works.append(dist.irecv(self.recv_buf, self.rank - 1, group=world_group()))
        return [w for w in works if w is not None]

    def wait(self, works: list[dist.Work]) -> None:
        wait_all(works, timeout_s=self.timeout_s, what="bench: hidden-state send/recv")


# -- event-loop heartbeat -------------------------------------------------------


@dataclass
class Heartbeat:
    """A task that sleeps 1 ms in a loop and records when it should have woken
    and when it did (lag = woke - due)."""

    period_ns: int = 1_000_000
    due_ns: list[int] = field(default_factory=list)
    woke_ns: list[int] = field(default_factory=list)

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Until cancelled."""
        task_status.started()
        period_s = self.period_ns / 1e9
        while True:
            t0 = now()
            await anyio.sleep(period_s)
            self.woke_ns.append(now())
            self.due_ns.append(t0 + self.period_ns)

    def arrays(self, since_ns: int) -> tuple[np.ndarray, np.ndarray]:
        """(due, woke) [n] int64 of the samples due at or after ``since_ns``."""
        due = np.asarray(self.due_ns, dtype=np.int64)
        woke = np.asarray(self.woke_ns, dtype=np.int64)
        keep = due >= since_ns
        return due[keep], woke[keep]


@contextmanager
def idle_loop() -> Iterator[Heartbeat]:
    """A :class:`Heartbeat` on an event loop that runs nothing else, in a
    thread of this process (meant for a process that only waits, as the
    bench's parent does while its ranks run): the lateness this machine's
    scheduler alone gives a loop sleeping like the bench's, at the same time.
    Read the heartbeat's samples after the block."""
    beat = Heartbeat()
    with anyio.from_thread.start_blocking_portal() as portal:
        task = portal.start_task_soon(beat.run)
        try:
            yield beat
        finally:
            task.cancel()


# -- ppsync's own CPU: the collective's issue and waits, timed apart ------------


# -- one rank's context ---------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RankCtx:
    """What a bench rank holds once the world is up."""

    opts: BenchOptions
    rank: int  # world rank (= group rank: every group spans the world)
    is_last: bool
    src: int  # global rank of the last rank, the broadcasts' source
    groups: tuple[tuple[str, dist.ProcessGroup], ...]  # (name, group) token traffic runs on
    step: FixedStep
    hidden: HiddenLink | None


def rank_ctx(opts: BenchOptions) -> RankCtx:
    """Build this rank's context: the dedicated token group (and, with
    ``hidden``, the world group as a second place for token traffic)."""
    world = world_group()
    tok = token_group(world, timeout_s=opts.timeout_s)
    rank = dist.get_rank()
    groups: tuple[tuple[str, dist.ProcessGroup], ...] = (("dedicated", tok),)
    hidden = None
    if opts.hidden is not None:
        groups += (("world", world),)
        hidden = HiddenLink(opts.hidden, rank=rank, pp_size=opts.pp_size,
                            timeout_s=opts.timeout_s)
    return RankCtx(
        opts=opts, rank=rank, is_last=rank == opts.pp_size - 1,
        src=dist.get_global_rank(tok, opts.pp_size - 1), groups=groups,
        step=fixed_step(opts.rows, opts.spec), hidden=hidden,
    )


T = TypeVar("T")


def run_async(fn: Callable[[RankCtx], Awaitable[T]], ctx: RankCtx) -> T:
    """``fn(ctx)`` under anyio on asyncio; a failure leaves as itself, not
    wrapped in an exception group (the parent reports it per rank)."""
    try:
        return anyio.run(fn, ctx, backend="asyncio")
    except BaseExceptionGroup as eg:
        cancelled = anyio.get_cancelled_exc_class()
        stack: list[BaseException] = [eg]
        while stack:
            e = stack.pop()
            if isinstance(e, BaseExceptionGroup):
                stack.extend(e.exceptions)
            elif not isinstance(e, cancelled):
                raise e from None
        raise
