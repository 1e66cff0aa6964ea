"""Run the synthetic workload over local ranks and gather a RunReport;
the table that ``ppsync launch`` and ``ppsync run`` print."""

from __future__ import annotations

import functools
from pathlib import Path

from ppsync.core.groups import pipeline_layout
from ppsync.harness.driver import Backend
from ppsync.harness.launcher import spawn_world
from ppsync.harness.rank import RunOptions, run_rank
from ppsync.schemas.config import SyncConfig
from ppsync.schemas.dump import DUMP_DIR_ENV
from ppsync.schemas.report import RunReport

__all__ = ["RunOptions", "format_table", "run_local"]


def run_local(
    config: SyncConfig,
    *,
    steps: int,
    seed: int = 0,
    backend: Backend | None = None,
    jitter_us: float = 0.0,
    knobs: dict[str, object] | None = None,
    world_size: int | None = None,
    progress_s: float | None = None,
    dump_dir: Path | None = None,
    emulate: str | None = None,
) -> RunReport:
    """Spawn ``world_size`` (default ``config.pp_size``) gloo ranks on
    127.0.0.1, each running the rank code of ``ppsync run``
    (:func:`~ppsync.harness.rank.run_rank`), ``steps`` steps of the workload
    through the synchronous token path (``backend`` None) or the anyio services
    on ``backend``, and report. ``dump_dir``: the ranks dump their flight
    records there (ppsync.core.dumps). ``emulate``: "nccl" makes the token
    groups behave as NCCL's (ppsync.core.completion.twin)."""
    opts = RunOptions(steps, seed, backend, jitter_us, dict(knobs or {}), progress_s,
                      emulate=emulate)
    target = functools.partial(run_rank, config, opts)
    world = config.pp_size if world_size is None else world_size
    pipeline_layout(world, config.pp_size)  # a bad ratio fails here, before any process
    # the whole run gets the collective timeout plus the time the steps take
    budget = config.timeout_s + steps * (0.01 + jitter_us / 1e6) * world
    env = {} if dump_dir is None else {DUMP_DIR_ENV: str(dump_dir)}
    # once a rank failed, the others fail on their own timeout (naming the lost
    # rank) or are ended soon after: the budget is a last resort
    return spawn_world(target, world, timeout_s=budget, env=env,
                       failed_grace_s=config.timeout_s + 5.0)[0]


def format_table(report: RunReport) -> str:
    """The per-rank table: one row per world rank, with its PP group.

    ``sent`` is the last rank's (rows needing a sample it broadcast); the
    receiver columns (expected, excluded, delivered) read against it: in a
    clean run every receiver has delivered = expected and
    sent = delivered + excluded. A column that does not apply to a rank's
    role shows ``-``."""
    head = (f"{'rank':>4} {'group':>5} {'role':<8} {'steps':>6} {'transfers':>9} {'sent':>7} "
            f"{'expected':>8} {'excluded':>8} {'delivered':>9} {'lost':>5} {'stale':>5} "
            f"{'dup':>4} {'corrupt':>7} {'p50_us':>8} {'p99_us':>8} {'rss_mb':>13}")
    lines = [head]
    for r in report.ranks:
        rank = r.rank if r.global_rank is None else r.global_rank
        last = r.role == "last"
        sent = r.rows_sent if last else "-"
        expected, excluded, delivered = (
            ("-", "-", "-") if last else (r.rows_expected, r.excluded, r.rows_delivered)
        )
        lines.append(
            f"{rank:>4} {r.pp_group:>5} {r.role:<8} {r.steps:>6} {r.transfers:>9} "
            f"{sent:>7} {expected:>8} {excluded:>8} {delivered:>9} {r.lost:>5} "
            f"{r.stale:>5} {r.duplicated:>4} {r.corrupt:>7} {r.sync_us_p50:>8.1f} "
            f"{r.sync_us_p99:>8.1f} {r.rss_start_mb:>6.0f}->{r.rss_end_mb:<6.0f}"
        )
    twin = [r for r in report.ranks if r.engine_waits_unconsumed is not None]
    if twin:
        lines.append(f"{report.ranks[0].completion}: engine-stream waits on transfers not yet "
                     "consumed (must be 0), and at consume:")
        lines += [f"  rank {r.global_rank if r.global_rank is not None else r.rank}: "
                  f"{r.engine_waits_unconsumed} unconsumed, {r.engine_waits_consumed} at consume"
                  for r in twin]
    c = report.config
    world = c.pp_size if report.world_size is None else report.world_size
    verdict = "OK: 0 lost / 0 stale / 0 duplicated / 0 corrupt" if report.ok else "FAULTS"
    lines.append(
        f"world={world} pp_size={c.pp_size} K={c.num_speculative_steps} D={c.depth} "
        f"max_num_reqs={c.max_num_reqs} wire={c.wire} codec={c.codec} "
        f"host_kernels={c.host_kernels} device_kernels={c.device_kernels} "
        f"mode={report.mode} -> {verdict}"
    )
    return "\n".join(lines)
