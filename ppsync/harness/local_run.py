"""Run the synthetic workload over local ranks and gather a RunReport;
the table that ``ppsync launch`` and ``ppsync run`` print."""

from __future__ import annotations

import functools
from pathlib import Path

from ppsync.core.wire.groups import pipeline_groups
from ppsync.errors import RankFailed, Stopped, SyncTimeout
from ppsync.harness.driver import Framework
from ppsync.harness.launcher import spawn_world
from ppsync.harness.rank import RunOptions, run_rank
from ppsync.harness.step_board import StepBoard
from ppsync.schemas.config import SyncConfig, frames_on_device
from ppsync.schemas.dump import DUMP_DIR_ENV
from ppsync.schemas.run_report import RankReport, RunReport

__all__ = ["RunOptions", "format_table", "run_local"]


STALL_GRACE_S = 10.0
"""How much longer than ``timeout_s`` a launched rank may go without
completing a step before the launcher ends it as stuck (its own waits end
within ``timeout_s``: past that it is stopped, or it hangs outside them)."""
SETUP_S = 120.0
"""How long a launched rank may take to reach its first step: joining the
world, making the groups, loading (the first time, compiling) the kernels."""


def run_local(
    config: SyncConfig,
    *,
    steps: int,
    seed: int = 0,
    framework: Framework | None = None,
    jitter_us: float = 0.0,
    knobs: dict[str, object] | None = None,
    world_size: int | None = None,
    progress_s: float | None = None,
    dump_dir: Path | None = None,
    emulate: str | None = None,
    keep_partial: bool = False,
    stacks: bool = False,
) -> RunReport:
    """Spawn ``world_size`` (default ``config.pp_size``) gloo ranks on
    127.0.0.1, each running the rank code of ``ppsync run``
    (:func:`~ppsync.harness.rank.run_rank`), ``steps`` steps of the workload
    through the synchronous token path (``framework`` None) or the anyio services
    on ``framework``, and report. ``dump_dir``: the ranks dump their flight
    records there (ppsync.core.recorder.on_error). ``emulate``: "nccl" makes the token
    groups behave as NCCL's (ppsync.core.wire.completion.twin).

    No bound is put on the whole run: a rank that completes no step for
    ``config.timeout_s`` + :data:`STALL_GRACE_S` is ended as stuck (and
    ``stacks``: prints its threads' stacks first). A run that fails, is
    stopped or is ended raises (:class:`RankFailed`, :class:`Stopped`,
    :class:`SyncTimeout`); with ``keep_partial`` it returns instead a report
    of what every rank had checked by then, ``ended`` saying why."""
    opts = RunOptions(steps, seed, framework, jitter_us, dict(knobs or {}), progress_s,
                      emulate=emulate)
    target = functools.partial(run_rank, config, opts)
    world = config.pp_size if world_size is None else world_size
    pp_groups = pipeline_groups(world, config.pp_size)  # a bad ratio fails here, before any process
    env = {} if dump_dir is None else {DUMP_DIR_ENV: str(dump_dir)}
    board = StepBoard(world)
    stall_s = config.timeout_s + STALL_GRACE_S
    try:
        # once a rank failed, the others fail on their own timeout (naming the lost
        # rank) or are ended soon after
        return spawn_world(target, world, timeout_s=config.timeout_s + SETUP_S, env=env,
                             failed_grace_s=config.timeout_s + 5.0, board=board,
                             stall_s=stall_s, setup_s=SETUP_S + stall_s, stacks=stacks)[0]
    except (RankFailed, SyncTimeout, Stopped) as e:
        if not keep_partial:
            raise
        return partial_report(config, opts, pp_groups, board, f"{type(e).__name__}: {e}")


def partial_report(config: SyncConfig, opts: RunOptions, pp_groups: list[list[int]],
                   board: StepBoard, ended: str) -> RunReport:
    """The report of a run ended early: every rank's last values on the
    board (what it had checked), ``ended`` saying why."""
    ranks = []
    for index, group in enumerate(pp_groups):
        for i, rank in enumerate(group):
            ranks.append(RankReport.model_validate({
                "rank": i, "global_rank": rank, "pp_group": index,
                "role": "last" if i == len(group) - 1 else "receiver", **board.row(rank)}))
    ranks.sort(key=lambda r: r.global_rank or 0)
    return RunReport(config=config, steps=opts.steps, seed=opts.seed,
                     mode="sync" if opts.framework is None else "async",
                     world_size=board.world_size, ranks=ranks, framework=opts.framework,
                     emulate=opts.emulate, ended=ended)


def format_table(report: RunReport) -> str:
    """The per-rank table: one row per world rank, with its PP group.

    ``sent`` is the last rank's (rows needing a sample it broadcast); the
    receiver columns (expected, excluded, delivered) read against it: in a
    clean run every receiver has delivered = expected and
    sent = delivered + excluded. A column that does not apply to a rank's
    role shows ``-``; so do the times and memory of a run ended early (its
    ranks' counts come from the step board)."""
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
        # a run ended early knows each rank's counts, not its times nor memory
        times = (f"{'-':>8} {'-':>8} {'-':>13}" if report.ended is not None else
                 f"{r.sync_us_p50:>8.1f} {r.sync_us_p99:>8.1f} "
                 f"{r.rss_start_mb:>6.0f}->{r.rss_end_mb:<6.0f}")
        lines.append(
            f"{rank:>4} {r.pp_group:>5} {r.role:<8} {r.steps:>6} {r.transfers:>9} "
            f"{sent:>7} {expected:>8} {excluded:>8} {delivered:>9} {r.lost:>5} "
            f"{r.stale:>5} {r.duplicated:>4} {r.corrupt:>7} {times}"
        )
    twin = [r for r in report.ranks if r.engine_waits_unconsumed is not None]
    if twin:
        lines.append(f"{report.ranks[0].completion}: engine-stream waits on transfers not yet "
                     "consumed (must be 0), and at consume:")
        lines += [f"  rank {r.global_rank if r.global_rank is not None else r.rank}: "
                  f"{r.engine_waits_unconsumed} unconsumed, {r.engine_waits_consumed} at consume"
                  for r in twin]
    carried = [r for r in report.ranks if r.copy_waits is not None]
    if carried:
        lines.append("the host carrier: pinned buffers reused before their copy ended, and "
                     "waits for a frame's copy to pinned memory (both must be 0: the engine's "
                     "thread never waits on a copy):")
        lines += [f"  rank {r.global_rank if r.global_rank is not None else r.rank}: "
                  f"{r.pinned_reused_early} reused early, {r.copy_waits} copy waits"
                  for r in carried]
    lines.append(verdict_line(report))
    return "\n".join(lines)


def _kernels(names: list[str | None]) -> str:
    """The kernel sets the ranks resolved: one name, or each, or "-" (none)."""
    seen = sorted({n for n in names if n is not None})
    return "/".join(seen) or "-"


def verdict_line(report: RunReport) -> str:
    """The last line of the table: everything the run used (the kernel sets as
    the ranks resolved them), then the verdict."""
    c = report.config
    world = c.pp_size if report.world_size is None else report.world_size
    if report.ended is not None:
        verdict = f"INCOMPLETE: ended before its last step ({report.ended.splitlines()[0]})"
        if any(r.faults for r in report.ranks):
            verdict = "FAULTS, " + verdict
    elif report.ok:
        verdict = "OK: 0 lost / 0 stale / 0 duplicated / 0 corrupt"
    else:
        verdict = "FAULTS"
    host = _kernels([r.cpu_kernels for r in report.ranks])
    on_device = frames_on_device(c.codec)
    kernels = (f"cpu_kernels={host if host != '-' else c.cpu_kernels}" if not on_device
               else f"device_kernels={_kernels([r.device_kernels for r in report.ranks])} "
               f"cpu_kernels={host}")
    if report.ended is not None:  # the ranks could not say what they resolved
        kernels = f"cpu_kernels={c.cpu_kernels}" + (
            f" device_kernels={c.device_kernels}" if on_device else "")
    emulate = f" emulate={report.emulate}" if report.emulate else ""
    mode = report.framework or report.mode
    carrier = f" carrier={c.carrier}" if on_device else ""
    return (f"world={world} pp_size={c.pp_size} K={c.num_speculative_steps} D={c.depth} "
            f"max_num_reqs={c.max_num_reqs} wire={c.wire} codec={c.codec}{carrier} {kernels}"
            f"{emulate} mode={mode} -> {verdict}")
