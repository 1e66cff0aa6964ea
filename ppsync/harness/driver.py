"""Drive one rank's token path with the synthetic workload, synchronously
(the core) or through the anyio services.

Both loops follow the engine order of ``ppsync.core.path.token_path``: consume
(non-last ranks), free slots, schedule, then post or publish. They run D
extra steps with empty batches at the end so every posted step is consumed
and checked. The time a rank's loop spends inside the token path per step is
recorded as its sync latency.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Awaitable, Callable, Generator
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Literal

import anyio
import numpy as np
import torch
import torch.distributed as dist

from ppsync.core.codec.released import ReleasedStep
from ppsync.core.frame.rows import SampledStep
from ppsync.core.path.token_path import TokenPath
from ppsync.core.wire.board import FailureBoard
from ppsync.harness import step_board
from ppsync.harness.checker import Checker
from ppsync.harness.synthetic_workload import ScheduledStep, Workload, WorkloadConfig
from ppsync.schemas.config import SyncConfig
from ppsync.schemas.run_report import RankReport
from ppsync.services.runtime import open_rank

Framework = Literal["asyncio", "trio"]


def workload_config(
    config: SyncConfig, *, steps: int, seed: int, **knobs: object
) -> WorkloadConfig:
    """The workload matching a token path configuration."""
    return WorkloadConfig(
        max_num_reqs=config.max_num_reqs,
        num_speculative_steps=config.num_speculative_steps,
        ring_depth=config.depth,
        seed=seed,
        steps=steps,
        **knobs,  # type: ignore[arg-type]
    )


def resident_mb() -> float:
    """This process's resident memory now, in MiB (Linux /proc; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[1])
    except (OSError, ValueError, IndexError):
        return 0.0
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def percentiles_us(samples_ns: np.ndarray) -> tuple[float, float]:
    """(p50, p99) in µs of a sample of durations in ns."""
    if samples_ns.size == 0:
        return 0.0, 0.0
    p50, p99 = np.percentile(samples_ns, [50, 99]) / 1e3
    return float(p50), float(p99)


@dataclass
class StepLoop:
    """The workload side of a rank's loop, shared by the sync and async drivers."""

    wcfg: WorkloadConfig
    is_last: bool
    rank: int = 0
    jitter_us: float = 0.0  # each step, pause uniformly in [0, jitter_us] (a slow, jittery rank)
    progress: Callable[[int], None] | None = None  # told each step index once it is done
    device: torch.device | None = None  # where the engine's tensors live (None: CPU)
    wl: Workload = field(init=False)
    checker: Checker = field(init=False)
    table: torch.Tensor | None = field(init=False)  # [max_num_reqs, K] draft table
    blocked_ns: np.ndarray = field(init=False)  # [steps + D] int64
    transfers: int = 0
    rows_sent: int = 0
    started: float = field(default_factory=time.perf_counter)
    rss_start_mb: float = field(default_factory=lambda: resident_mb())

    def __post_init__(self) -> None:
        self._jitter = np.random.default_rng([self.wcfg.seed, self.rank, 7])
        self.wl = Workload(self.wcfg)
        self.checker = Checker(self.wl)
        K = self.wcfg.num_speculative_steps
        self.table = torch.full((self.wcfg.max_num_reqs, K), -1, dtype=torch.int64,
                                device=self.device) if K else None
        self.blocked_ns = np.zeros(self.total_steps, dtype=np.int64)

    @property
    def total_steps(self) -> int:
        return self.wcfg.steps + self.wcfg.ring_depth

    def released(self, t: int, released: ReleasedStep | None) -> None:
        table = self.table
        if released is not None and released.sampled_tokens.device.type != "cpu":
            released = on_host(released)  # the checker's copy, outside the hot calls
        if table is not None and table.device.type != "cpu":
            table = table.cpu()
        self.checker.check(t, released, table)

    def pause_s(self) -> float:
        """This step's injected delay, in seconds (0 without jitter)."""
        return float(self._jitter.uniform(0, self.jitter_us)) / 1e6 if self.jitter_us else 0.0

    def schedule(self, t: int, free: TokenPath) -> ScheduledStep:
        for slot in self.wl.begin_step(t):
            free.free(slot)
        return self.wl.schedule(t)

    def sent(self, t: int, needed: int, blocked_ns: int) -> None:
        self.blocked_ns[t] = blocked_ns
        self.transfers += needed > 0
        if self.is_last:
            self.rows_sent += needed
        if self.progress is not None:
            self.progress(t)
        step_board.note(t + 1, self.transfers, self.rows_sent, self.checker.tally)

    def report(self, rank: int) -> RankReport:
        p50, p99 = percentiles_us(self.blocked_ns[: self.wcfg.steps])
        tl = self.checker.tally
        return RankReport(
            rank=rank, role="last" if self.is_last else "receiver", steps=self.wcfg.steps,
            transfers=self.transfers, rows_sent=self.rows_sent, rows_expected=tl.rows_expected,
            excluded=tl.excluded, rows_delivered=tl.delivered, lost=tl.lost, stale=tl.stale,
            duplicated=tl.duplicated, corrupt=tl.corrupt, sync_us_p50=p50, sync_us_p99=p99,
            wall_s=time.perf_counter() - self.started,
            rss_start_mb=self.rss_start_mb, rss_end_mb=resident_mb(),
        )


def skips_call(t: int, step: ScheduledStep) -> bool:
    """Whether step ``t`` calls neither post nor publish. Engines differ on an
    empty schedule: vLLM skips the token path's calls (the ring slot stays
    empty on every rank), others pass an empty batch (no transfer). The
    workload does both, on alternate empty steps, the same on every rank."""
    return step.view.num_reqs == 0 and t % 2 == 0


def outputs(step: ScheduledStep, device: torch.device | None = None) -> SampledStep:
    """The last rank's sampled rows for ``step``, as the engine hands them
    (on ``device``: where a GPU engine's sampler leaves them): the record is
    built here, at the engine's edge."""
    drafts = None if step.drafts_np is None else torch.from_numpy(step.drafts_np)
    out = SampledStep(torch.from_numpy(step.tokens_np[:, : step.width]),
                      torch.from_numpy(step.num_sampled_np),
                      torch.from_numpy(step.num_rejected_np), drafts)
    if device is None or device.type == "cpu":
        return out
    return SampledStep(out.tokens.to(device), out.num_sampled.to(device),
                       out.num_rejected.to(device), None if drafts is None else drafts.to(device))


def _tensors(sampled: SampledStep) -> tuple[torch.Tensor | None, ...]:
    return sampled.tokens, sampled.num_sampled, sampled.num_rejected, sampled.drafts


def engine_owned(sampled: SampledStep) -> SampledStep:
    """The sampled rows in tensors the engine owns and reuses (copies:
    :func:`outputs` views the workload's own arrays)."""
    drafts = sampled.drafts
    return SampledStep(sampled.tokens.clone(), sampled.num_sampled.clone(),
                       sampled.num_rejected.clone(), None if drafts is None else drafts.clone(),
                       sampled.sample_width)


def overwrite(sampled: SampledStep | None) -> None:
    """What an engine may do once publish returned: write its sampler's
    tensors in place (the next step's outputs, here values the checker would
    call corrupt and counts out of range). Publish owns what it sends
    (docs/design.md, "Own what you send"): receivers never see these."""
    if sampled is None:
        return
    for t in _tensors(sampled):
        if t is not None:
            t.fill_(99 if t.dtype == torch.int32 else -5)


def on_host(released: ReleasedStep) -> ReleasedStep:
    """A CPU copy of a released step (for the checker; syncs the device)."""
    drafts = released.draft_tokens
    return dataclasses.replace(
        released, sampled_tokens=released.sampled_tokens.cpu(),
        num_sampled=released.num_sampled.cpu(), num_rejected=released.num_rejected.cpu(),
        idx_mapping=released.idx_mapping.cpu(),
        draft_tokens=None if drafts is None else drafts.cpu())


Call = tuple[str, tuple[object, ...]]
"""A call the engine loop asks its driver to make: (name, arguments); the
names are ``sleep``, ``consume``, ``post`` and ``publish``."""


def engine_steps(loop: StepLoop, path: TokenPath,
                 device: torch.device | None) -> Generator[Call, object, None]:
    """One rank's engine loop, written once for both drivers: yields each
    call for the driver to make (synchronously or awaited) and receives its
    result; the time spent in each token-path call is the step's latency."""
    is_last = path.is_last
    for t in range(loop.total_steps):
        if loop.jitter_us:
            yield "sleep", (loop.pause_s(),)
        spent = 0
        if not is_last:
            t0 = time.perf_counter_ns()
            released = yield "consume", (loop.table,)
            spent = time.perf_counter_ns() - t0
            assert released is None or isinstance(released, ReleasedStep)
            loop.released(t, released)
        step = loop.schedule(t, path)
        if skips_call(t, step):
            loop.sent(t, 0, spent)
            continue
        sampled = engine_owned(outputs(step, device)) if is_last else None
        call: Call = ("publish", (step.view, sampled)) if is_last else ("post", (step.view,))
        t0 = time.perf_counter_ns()
        needed = yield call
        assert isinstance(needed, int)
        loop.sent(t, needed, spent + time.perf_counter_ns() - t0)
        overwrite(sampled)


def next_call(steps: Generator[Call, object, None], result: object) -> Call | None:
    """The loop's next call, given the last one's result; None at its end."""
    try:
        return steps.send(result)
    except StopIteration:
        return None


def run_sync_rank(
    path: TokenPath,
    wcfg: WorkloadConfig,
    *,
    jitter_us: float = 0.0,
    progress: Callable[[int], None] | None = None,
    hot: Callable[[], AbstractContextManager[object]] = nullcontext,
) -> RankReport:
    """Run ``wcfg.steps`` steps (plus D to drain) through the core. With the
    device codec the engine's tensors live on the path's device. ``hot``
    wraps each token-path call (the GPU check forbids host syncs there)."""
    device = path.codec.device if path.codec.on_device else None
    loop = StepLoop(wcfg, path.is_last, path.rank, jitter_us, progress, device)
    calls: dict[str, Callable[..., object]] = {
        "consume": path.consume, "post": path.post, "publish": path.publish}
    steps = engine_steps(loop, path, device)
    result: object = None
    while (call := next_call(steps, result)) is not None:
        name, args = call
        if name == "sleep":
            time.sleep(*args)  # type: ignore[arg-type]
            result = None
            continue
        with hot():
            result = calls[name](*args)
    path.close()
    return with_kernels(loop.report(path.rank), path)


def with_kernels(report: RankReport, path: TokenPath) -> RankReport:
    """``report`` naming the kernel sets ``path`` resolved ("auto" chosen)."""
    device = path.codec.device_kernels_name
    return report.model_copy(update={
        "cpu_kernels": path.codec.kernels.name,
        "device_kernels": None if device == "none" else device})


def run_async_rank_blocking(
    config: SyncConfig,
    group: dist.ProcessGroup,
    wcfg: WorkloadConfig,
    framework: Framework,
    board: FailureBoard | None = None,
    jitter_us: float = 0.0,
    progress: Callable[[int], None] | None = None,
    device: torch.device | None = None,
) -> RankReport:
    """Run ``wcfg.steps`` steps (plus D to drain) through the anyio services,
    under ``anyio.run`` on ``framework`` (``device``: the device codec's, where
    the engine's tensors live)."""

    async def run() -> RankReport:
        async with open_rank(config, group, board=board, device=device) as rank:
            loop = StepLoop(wcfg, rank.is_last, rank.rank, jitter_us, progress, device)
            calls: dict[str, Callable[..., Awaitable[object]]] = {
                "sleep": anyio.sleep, "consume": rank.take, "post": rank.post,
                "publish": rank.publish}
            steps = engine_steps(loop, rank.path, device)
            result: object = None
            while (call := next_call(steps, result)) is not None:
                name, args = call
                result = await calls[name](*args)
        return with_kernels(loop.report(rank.rank), rank.path)

    return anyio.run(run, backend=framework)
