"""Run the synthetic workload over P local ranks and gather a RunReport."""

from __future__ import annotations

import functools

import torch.distributed as dist

from ppsync.core.groups import token_group
from ppsync.core.handler import TokenPath
from ppsync.schemas.config import SyncConfig
from ppsync.schemas.report import RankReport, RunReport
from ppsync.services.driver import (
    Backend,
    run_async_rank_blocking,
    run_sync_rank,
    workload_config,
)
from ppsync.services.launcher import RankEnv, spawn_ranks


def _rank(
    config: SyncConfig, steps: int, seed: int, backend: Backend | None, env: RankEnv
) -> RankReport:
    group = token_group(dist.group.WORLD, timeout_s=config.timeout_s)  # type: ignore[arg-type]
    wcfg = workload_config(config, steps=steps, seed=seed)
    board = env.failure_board(group)
    if backend is None:
        return run_sync_rank(TokenPath(config, group, board=board), wcfg)
    return run_async_rank_blocking(config, group, wcfg, backend, board)


def run_local(
    config: SyncConfig, *, steps: int, seed: int = 0, backend: Backend | None = None
) -> RunReport:
    """Spawn ``config.pp_size`` gloo ranks on 127.0.0.1, run ``steps`` steps of
    the workload through the synchronous token path (``backend`` None) or the
    anyio services on ``backend``, and report."""
    target = functools.partial(_rank, config, steps, seed, backend)
    # the whole run gets the collective timeout plus the time the steps take
    budget = config.timeout_s + steps * 0.01 * config.pp_size
    ranks = spawn_ranks(target, config.pp_size, timeout_s=budget)
    return RunReport(config=config, steps=steps, seed=seed,
                     mode="sync" if backend is None else "async", ranks=ranks)


def format_table(report: RunReport) -> str:
    """The per-rank table ``ppsync launch`` prints."""
    head = (f"{'rank':>4} {'role':<8} {'steps':>6} {'transfers':>9} {'sent':>7} "
            f"{'expected':>8} {'delivered':>9} {'lost':>5} {'stale':>5} {'dup':>4} "
            f"{'corrupt':>7} {'p50_us':>8} {'p99_us':>8}")
    lines = [head]
    for r in report.ranks:
        lines.append(
            f"{r.rank:>4} {r.role:<8} {r.steps:>6} {r.transfers:>9} {r.rows_sent:>7} "
            f"{r.rows_expected:>8} {r.rows_delivered:>9} {r.lost:>5} {r.stale:>5} "
            f"{r.duplicated:>4} {r.corrupt:>7} {r.sync_us_p50:>8.1f} {r.sync_us_p99:>8.1f}"
        )
    c = report.config
    verdict = "OK: 0 lost / 0 stale / 0 duplicated / 0 corrupt" if report.ok else "FAULTS"
    lines.append(
        f"pp_size={c.pp_size} K={c.num_speculative_steps} D={c.depth} "
        f"max_num_reqs={c.max_num_reqs} wire={c.wire} mode={report.mode} -> {verdict}"
    )
    return "\n".join(lines)
