"""Run the synthetic workload over P local ranks and gather a RunReport."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch.distributed as dist

from ppsync.core.groups import token_group
from ppsync.core.handler import TokenPath
from ppsync.harness.driver import (
    Backend,
    run_async_rank_blocking,
    run_sync_rank,
    workload_config,
)
from ppsync.harness.launcher import RankEnv, spawn_ranks
from ppsync.schemas.config import SyncConfig
from ppsync.schemas.report import RankReport, RunReport


@dataclass(frozen=True, slots=True)
class RunOptions:
    """How ``run_local`` drives the ranks (beyond the token path's config)."""

    steps: int
    seed: int = 0
    backend: Backend | None = None  # None: the synchronous core
    jitter_us: float = 0.0  # per rank per step, a random pause in [0, jitter_us]
    knobs: dict[str, object] = field(default_factory=dict)  # WorkloadConfig overrides


def _rank(config: SyncConfig, opts: RunOptions, env: RankEnv) -> RankReport:
    group = token_group(dist.group.WORLD, timeout_s=config.timeout_s)  # type: ignore[arg-type]
    wcfg = workload_config(config, steps=opts.steps, seed=opts.seed, **opts.knobs)
    board = env.failure_board(group)
    if opts.backend is None:
        path = TokenPath(config, group, board=board)
        return run_sync_rank(path, wcfg, jitter_us=opts.jitter_us)
    return run_async_rank_blocking(config, group, wcfg, opts.backend, board, opts.jitter_us)


def run_local(
    config: SyncConfig,
    *,
    steps: int,
    seed: int = 0,
    backend: Backend | None = None,
    jitter_us: float = 0.0,
    knobs: dict[str, object] | None = None,
) -> RunReport:
    """Spawn ``config.pp_size`` gloo ranks on 127.0.0.1, run ``steps`` steps of
    the workload through the synchronous token path (``backend`` None) or the
    anyio services on ``backend``, and report."""
    opts = RunOptions(steps, seed, backend, jitter_us, dict(knobs or {}))
    target = functools.partial(_rank, config, opts)
    # the whole run gets the collective timeout plus the time the steps take
    budget = config.timeout_s + steps * (0.01 + jitter_us / 1e6) * config.pp_size
    ranks = spawn_ranks(target, config.pp_size, timeout_s=budget)
    return RunReport(config=config, steps=steps, seed=seed,
                     mode="sync" if backend is None else "async", ranks=ranks)


def format_table(report: RunReport) -> str:
    """The per-rank table ``ppsync launch`` prints."""
    head = (f"{'rank':>4} {'role':<8} {'steps':>6} {'transfers':>9} {'sent':>7} "
            f"{'expected':>8} {'delivered':>9} {'lost':>5} {'stale':>5} {'dup':>4} "
            f"{'corrupt':>7} {'p50_us':>8} {'p99_us':>8} {'rss_mb':>13}")
    lines = [head]
    for r in report.ranks:
        lines.append(
            f"{r.rank:>4} {r.role:<8} {r.steps:>6} {r.transfers:>9} {r.rows_sent:>7} "
            f"{r.rows_expected:>8} {r.rows_delivered:>9} {r.lost:>5} {r.stale:>5} "
            f"{r.duplicated:>4} {r.corrupt:>7} {r.sync_us_p50:>8.1f} {r.sync_us_p99:>8.1f} "
            f"{r.rss_start_mb:>6.0f}->{r.rss_end_mb:<6.0f}"
        )
    c = report.config
    verdict = "OK: 0 lost / 0 stale / 0 duplicated / 0 corrupt" if report.ok else "FAULTS"
    lines.append(
        f"pp_size={c.pp_size} K={c.num_speculative_steps} D={c.depth} "
        f"max_num_reqs={c.max_num_reqs} wire={c.wire} mode={report.mode} -> {verdict}"
    )
    return "\n".join(lines)
