"""``ppsync bench``: what the token path costs, against raw broadcasts and
today's scheme, on P local gloo ranks.

One spawn of P ranks runs the lockstep benchmark (``bench_lockstep``: four
variants interleaved per iteration, each waiting its own transfer; the worst
case) and then the pipelined one (``bench_pipelined``: an engine-like loop
with simulated compute and D steps in flight; the headline). Each rank hands
back raw perf_counter_ns samples; the parent turns them into a
:class:`~ppsync.schemas.bench.BenchReport` (spans need every rank's
timestamps: max(out) - min(in) per iteration), adds the hot own-CPU figure
of the real token path (``codec_cpu.path_cpu``: a last rank's and a
receiver's path in one process, a tight loop of publish / consume + post),
the flight recorder's CPU (``bench.cpu``), the ratios and the targets
(:data:`TARGETS`: goals, printed for their configuration only).
Benchmarks report figures; nothing here asserts a timing.
"""

from __future__ import annotations

import functools
import time
from dataclasses import asdict

import numpy as np

from ppsync.bench.codec_cpu import hot_config, path_cpu
from ppsync.bench.common import Heartbeat, idle_loop, rank_ctx, world_barrier
from ppsync.bench.cpu import recorder_cpu
from ppsync.bench.dispatches import Counts, call_targets, count_all, format_table
from ppsync.bench.lockstep import VARIANTS, LockstepRankResult, lockstep_rank
from ppsync.bench.pipelined import (
    SCHEMES,
    PipelinedRankResult,
    pipelined_rank,
    rounds,
)
from ppsync.bench.stats import pct_us, ratio
from ppsync.core.frame.numpy_frames import NumpyFrames
from ppsync.harness.fresh import in_fresh_process
from ppsync.harness.launcher import RankEnv, spawn_ranks
from ppsync.schemas.bench import (
    BenchOptions,
    BenchReport,
    CpuStats,
    LockstepStats,
    PipelinedStats,
    Target,
)

__all__ = ["BenchOptions", "BenchReport", "format_tables", "run_bench"]

RankResult = tuple[LockstepRankResult, PipelinedRankResult]


def _rank(opts: BenchOptions, env: RankEnv) -> RankResult:
    ctx = rank_ctx(opts)
    lock = lockstep_rank(ctx)
    world_barrier(timeout_s=opts.timeout_s)
    return lock, pipelined_rank(ctx)


def _budget_s(opts: BenchOptions) -> float:
    """A generous bound on the whole run (a hang guard; every collective is
    bounded by timeout_s on its own)."""
    per_op_s = 0.004
    if opts.hidden is not None:
        per_op_s += 3 * opts.hidden[0] * opts.hidden[1] * 4 / 2e8  # 200 MB/s, worst case
    groups = len(opts.group_names)
    lock = (opts.warmup + opts.iters) * len(VARIANTS) * groups * 2.5 * per_op_s
    n_rounds, _ = rounds(opts.pipelined_iters)
    pipe = ((opts.pipelined_iters + opts.warmup + 4 * opts.pp_size * n_rounds)
            * len(SCHEMES) * groups * (opts.compute_us * 1e-6 + per_op_s))
    return opts.timeout_s + 30.0 + 3 * (lock + pipe)


def run_bench(opts: BenchOptions) -> BenchReport:
    """Spawn ``opts.pp_size`` gloo ranks, run both benchmarks, and report."""
    started = time.perf_counter()
    with idle_loop() as idle:
        results = spawn_ranks(functools.partial(_rank, opts), opts.pp_size,
                              timeout_s=_budget_s(opts))
    lock = [r[0] for r in results]
    pipe = [r[1] for r in results]
    lockstep = _lockstep_stats(opts, lock)
    pipelined = _pipelined_stats(opts, pipe)
    last_hot, recv_hot = path_cpu({"host": hot_config(opts)}, iters=3000, vllm=True)
    rec = recorder_cpu(opts)
    counted = in_fresh_process(count_all, opts.rows, opts.spec, 20)
    pipe_cpu = [np.concatenate(r.series["ppsync_sync@dedicated"].cpu_ns) for r in pipe]
    vllm_cpu = [np.concatenate(r.series["vllm@dedicated"].cpu_ns) for r in pipe]
    cpu = CpuStats(
        last_inrun_p50_us=pct_us(lock[-1].cpu_ns, 50),
        receiver_inrun_p50_us=max(pct_us(r.cpu_ns, 50) for r in lock[:-1]),
        last_pipelined_p50_us=pct_us(pipe_cpu[-1], 50),
        receiver_pipelined_p50_us=max(pct_us(a, 50) for a in pipe_cpu[:-1]),
        last_micro_p50_us=last_hot["host"],
        receiver_micro_p50_us=recv_hot["host"],
        vllm_last_pipelined_p50_us=pct_us(vllm_cpu[-1], 50),
        vllm_receiver_pipelined_p50_us=max(pct_us(a, 50) for a in vllm_cpu[:-1]),
        vllm_last_micro_p50_us=last_hot["vllm"],
        vllm_receiver_micro_p50_us=recv_hot["vllm"],
        recorder_last_us=rec["last_on"], recorder_last_off_us=rec["last_off"],
        recorder_receiver_us=rec["receiver_on"], recorder_receiver_off_us=rec["receiver_off"],
    )
    lag_p99 = max(pct_us(r.lag_ns, 99) for r in lock)
    idle_lag = _idle_lag_p99_us(idle, pipe[0].series["ppsync_async@dedicated"].spans)
    ratios = _ratios(opts, lockstep, pipelined)
    reference = is_reference(opts)
    return BenchReport(
        options=opts,
        frame_words=NumpyFrames(opts.sync_config(ring_depth=1)).words(opts.rows),
        slot_us=lock[0].slot_ns / 1e3,
        lockstep=lockstep,
        lockstep_lag_p99_us=lag_p99,
        idle_lag_p99_us=idle_lag,
        dispatches={scheme: {role: asdict(c) for role, c in roles.items()}
                    for scheme, roles in counted.items()},
        pipelined=pipelined,
        cpu=cpu,
        ratios=ratios,
        targets=_targets(opts, ratios, cpu, idle_lag, pipelined) + call_targets(counted),
        reference_config=reference,
        wall_s=time.perf_counter() - started,
    )


def _idle_lag_p99_us(idle: Heartbeat, spans: list[tuple[int, int]]) -> float:
    """p99 of the idle loop's raw lateness over the samples due while the
    ppsync_async chunks ran (their measured steps)."""
    due = np.asarray(idle.due_ns, dtype=np.int64)
    late = np.maximum(np.asarray(idle.woke_ns, dtype=np.int64) - due, 0)
    inside = np.zeros(due.shape, dtype=bool)
    for start, end in spans:
        inside |= (due >= start) & (due <= end)
    return pct_us(late[inside], 99) if inside.any() else 0.0


def _lockstep_stats(opts: BenchOptions, lock: list[LockstepRankResult]) -> list[LockstepStats]:
    t_in = np.stack([r.t_in for r in lock])  # [P, iters, V]
    t_out = np.stack([r.t_out for r in lock])  # [P, iters, V]
    out = []
    for k in range(t_in.shape[2]):
        span = t_out[:, :, k].max(axis=0) - t_in[:, :, k].min(axis=0)  # [iters]
        own = t_out[:, :, k] - t_in[:, :, k]  # [P, iters]
        out.append(LockstepStats(
            variant=VARIANTS[k % len(VARIANTS)],
            group=opts.group_names[k // len(VARIANTS)],
            span_p50_us=pct_us(span, 50),
            span_p99_us=pct_us(span, 99),
            last_p50_us=pct_us(own[-1], 50),
            receiver_p50_us=max(pct_us(own[r], 50) for r in range(opts.pp_size - 1)),
        ))
    return out


def _pipelined_stats(opts: BenchOptions, pipe: list[PipelinedRankResult]) -> list[PipelinedStats]:
    out = []
    for group in opts.group_names:
        for scheme in SCHEMES:
            per_rank = [r.series[f"{scheme}@{group}"] for r in pipe]
            step = [np.concatenate(s.step_ns) for s in per_rank]
            blocked = [np.concatenate(s.blocked_ns) for s in per_rank]
            recv = per_rank[:-1]
            counted = sum(s.counted for s in recv)
            is_async = scheme == "ppsync_async"
            out.append(PipelinedStats(
                variant=scheme,
                group=group,
                step_p50_us=max(pct_us(a, 50) for a in step),
                step_mean_us=max(float(a.mean()) / 1e3 for a in step),
                blocked_p50_us=max(pct_us(a, 50) for a in blocked),
                blocked_mean_us=max(float(a.mean()) / 1e3 for a in blocked),
                blocked_last_p50_us=pct_us(blocked[-1], 50),
                blocked_receiver_p50_us=max(pct_us(a, 50) for a in blocked[:-1]),
                complete_at_consume=(sum(s.complete for s in recv) / counted
                                     if scheme != "vllm" and counted else None),
                lag_p99_us=max(pct_us(np.concatenate(s.lag_ns), 99) for s in per_rank)
                if is_async else None,
                lag_raw_p99_us=max(pct_us(np.concatenate(s.lag_raw_ns), 99) for s in per_rank)
                if is_async else None,
            ))
    return out


def _ratios(opts: BenchOptions, lockstep: list[LockstepStats],
            pipelined: list[PipelinedStats]) -> dict[str, float]:
    span = {(s.variant[0], s.group): s.span_p50_us for s in lockstep}
    pipe = {(s.variant, s.group): s for s in pipelined}
    out: dict[str, float] = {}
    for g in opts.group_names:
        at = "" if g == "dedicated" else "@world"
        for num, den in (("c", "a"), ("c", "b"), ("d", "a"), ("d", "b")):
            out[f"{num}/{den}{at}"] = ratio(span[num, g], span[den, g])
        vllm = pipe["vllm", g]
        for scheme, short in (("ppsync_sync", "sync"), ("ppsync_async", "async")):
            p = pipe[scheme, g]
            out[f"{short}/vllm step{at}"] = ratio(p.step_p50_us, vllm.step_p50_us)
            out[f"{short}/vllm blocked{at}"] = ratio(p.blocked_p50_us, vllm.blocked_p50_us)
    if opts.hidden is not None:  # what the dedicated group is worth
        for v in "abcd":
            out[f"{v} world/dedicated"] = ratio(span[v, "world"], span[v, "dedicated"])
        for scheme in SCHEMES:
            out[f"{scheme} step world/dedicated"] = ratio(
                pipe[scheme, "world"].step_p50_us, pipe[scheme, "dedicated"].step_p50_us)
    return out


TARGETS: dict[str, tuple[float, float]] = {
    "pipelined sync/vllm step": (0.45, 0.45),
    "pipelined sync/vllm blocked": (0.15, 0.15),
    "lockstep c/b": (1.0, 0.8),
    "lockstep c/a": (1.35, 1.35),
    "lockstep d/a": (1.8, 1.8),
    "own CPU last rank us (hot)": (10.0, 10.0),
    "own CPU receiver us (hot)": (10.0, 10.0),
    "own CPU last rank / vLLM's (hot)": (1.0, 1.0),
    "own CPU receiver / vLLM's (hot)": (1.0, 1.0),
    "own CPU last rank us (pipelined)": (30.0, 30.0),
    "own CPU receiver us (pipelined)": (30.0, 30.0),
    "flight recorder us per step, last rank": (2.0, 2.0),
    "flight recorder us per step, receiver": (2.0, 2.0),
    "loop lag p99 added over idle us": (500.0, 500.0),
}
"""The bench targets, the one definition (docs/measured.md quotes it, and a
test compares): name -> (limit at K = 0, limit at K = 3). Goals set for
:data:`REFERENCE`, reported with met / MISSED, never checked."""
REFERENCE = "P=2, 256 rows, K=0 or 3, C=400 us, no --hidden"
"""The configuration the targets were set for, in words."""


def is_reference(opts: BenchOptions) -> bool:
    """Whether ``opts`` is the configuration the targets were set for."""
    return ((opts.pp_size, opts.rows, opts.compute_us) == (2, 256, 400)
            and opts.spec in (0, 3) and opts.hidden is None)


def _targets(opts: BenchOptions, ratios: dict[str, float], cpu: CpuStats, idle_lag_us: float,
             pipelined: list[PipelinedStats]) -> list[Target]:
    """Each of :data:`TARGETS` against this run's figure (reported only)."""
    async_lag = next(s.lag_p99_us for s in pipelined
                     if s.variant == "ppsync_async" and s.group == "dedicated") or 0.0
    values = {
        "pipelined sync/vllm step": ratios["sync/vllm step"],
        "pipelined sync/vllm blocked": ratios["sync/vllm blocked"],
        "lockstep c/b": ratios["c/b"],
        "lockstep c/a": ratios["c/a"],
        "lockstep d/a": ratios["d/a"],
        "own CPU last rank us (hot)": cpu.last_micro_p50_us,
        "own CPU receiver us (hot)": cpu.receiver_micro_p50_us,
        "own CPU last rank / vLLM's (hot)":
            ratio(cpu.last_micro_p50_us, cpu.vllm_last_micro_p50_us),
        "own CPU receiver / vLLM's (hot)":
            ratio(cpu.receiver_micro_p50_us, cpu.vllm_receiver_micro_p50_us),
        "own CPU last rank us (pipelined)": cpu.last_pipelined_p50_us,
        "own CPU receiver us (pipelined)": cpu.receiver_pipelined_p50_us,
        # the recorder's own calls: on less off (the measuring loop's share)
        "flight recorder us per step, last rank": cpu.recorder_last_us - cpu.recorder_last_off_us,
        "flight recorder us per step, receiver":
            cpu.recorder_receiver_us - cpu.recorder_receiver_off_us,
        "loop lag p99 added over idle us": async_lag - idle_lag_us,
    }
    k = 0 if opts.spec == 0 else 1
    return [Target(name=n, value=values[n], limit=limits[k], met=values[n] <= limits[k])
            for n, limits in TARGETS.items()]


# -- the printed tables ---------------------------------------------------------

_LOCK_HEAD = (f"{'variant':<16} {'group':<9} {'span_p50':>9} {'span_p99':>9} "
              f"{'last_p50':>9} {'recv_p50':>9}")
_PIPE_HEAD = (f"{'scheme':<13} {'group':<9} {'step_p50':>9} {'step_mean':>9} "
              f"{'blk_p50':>8} {'blk_mean':>8} {'blk_last':>8} {'blk_recv':>8} "
              f"{'done@cons':>9} {'lag_p99':>8}")


def _opt(v: float | None, fmt: str) -> str:
    return format(v, fmt) if v is not None else "-"


def format_tables(report: BenchReport) -> str:
    """The tables ``ppsync bench`` prints (times in µs)."""
    o, r = report.options, report.ratios
    n_rounds, per_round = rounds(o.pipelined_iters)
    hidden = f", hidden {o.hidden[0]}x{o.hidden[1]}" if o.hidden else ""
    lines = [
        f"lockstep: P={o.pp_size} rows={o.rows} K={o.spec} iters={o.iters} "
        f"frame={report.frame_words} words slot={report.slot_us:.0f} us{hidden} (times in us)",
        _LOCK_HEAD,
    ]
    for s in report.lockstep:
        lines.append(f"{s.variant:<16} {s.group:<9} {s.span_p50_us:>9.1f} {s.span_p99_us:>9.1f} "
                     f"{s.last_p50_us:>9.1f} {s.receiver_p50_us:>9.1f}")
    lines.append(f"ratios (span p50): c/a {r['c/a']:.2f}  c/b {r['c/b']:.2f}  "
                 f"d/a {r['d/a']:.2f}  d/b {r['d/b']:.2f}   "
                 "(span: first rank in to last rank out)")
    c = report.cpu
    lines += [
        "own CPU per step (p50 of thread CPU time, us): lockstep c / pipelined sync / "
        "hot (real path, tight loop, issue and waits subtracted)",
        f"  last rank {c.last_inrun_p50_us:.1f} / {c.last_pipelined_p50_us:.1f} / "
        f"{c.last_micro_p50_us:.1f};  receiver {c.receiver_inrun_p50_us:.1f} / "
        f"{c.receiver_pipelined_p50_us:.1f} / {c.receiver_micro_p50_us:.1f}",
        "  vLLM's scheme's host calls, pipelined / hot (broadcasts excluded): last rank "
        f"{c.vllm_last_pipelined_p50_us:.1f} / {c.vllm_last_micro_p50_us:.1f};  receiver "
        f"{c.vllm_receiver_pipelined_p50_us:.1f} / {c.vllm_receiver_micro_p50_us:.1f}",
        f"flight recorder per step (us, its calls alone): last rank {c.recorder_last_us:.2f} "
        f"on / {c.recorder_last_off_us:.2f} off; receiver {c.recorder_receiver_us:.2f} on / "
        f"{c.recorder_receiver_off_us:.2f} off",
        f"loop lag p99 (d): {report.lockstep_lag_p99_us:.1f} us",
        "",
        f"pipelined: P={o.pp_size} rows={o.rows} K={o.spec} compute={o.compute_us} us "
        f"D={o.pp_size} steps={n_rounds * per_round} in {n_rounds} rounds{hidden} (times in us)",
        _PIPE_HEAD,
    ]
    for p in report.pipelined:
        lines.append(
            f"{p.variant:<13} {p.group:<9} {p.step_p50_us:>9.1f} {p.step_mean_us:>9.1f} "
            f"{p.blocked_p50_us:>8.1f} {p.blocked_mean_us:>8.1f} {p.blocked_last_p50_us:>8.1f} "
            f"{p.blocked_receiver_p50_us:>8.1f} {_opt(p.complete_at_consume, '.3f'):>9} "
            f"{_opt(p.lag_p99_us, '.1f'):>8}"
        )
    lines.append("blk: time per step the loop spent in the token path; done@cons: share of "
                 "receiver steps whose transfer had completed before consume; lag_p99: "
                 "heartbeat lateness inside the token calls")
    lines.append(f"an idle loop's lag p99 at the same time (the same heartbeat in the parent "
                 f"process, raw, during ppsync_async): {report.idle_lag_p99_us:.1f} us")
    lines.append(
        f"ratios (p50): sync/vllm step {r['sync/vllm step']:.2f} blocked "
        f"{r['sync/vllm blocked']:.2f}; async/vllm step {r['async/vllm step']:.2f} "
        f"blocked {r['async/vllm blocked']:.2f}"
    )
    if o.hidden is not None:
        at_world = "  ".join(f"{k.removesuffix('@world')} {v:.2f}"
                             for k, v in r.items() if k.endswith("@world"))
        vs = "  ".join(f"{k.removesuffix(' world/dedicated')} {v:.2f}"
                       for k, v in r.items() if k.endswith("world/dedicated"))
        lines += ["", f"ratios on the world group: {at_world}",
                  f"world group vs dedicated (p50, world / dedicated): {vs}"]
    if report.dispatches:
        counts = {o.spec: {scheme: {role: Counts(**c) for role, c in roles.items()}
                           for scheme, roles in report.dispatches.items()}}
        lines += ["", format_table(o.rows, counts)]
    if report.reference_config:
        lines += ["", f"targets (goals set for {REFERENCE}; reported, never checked: the "
                  "bench exits 0 whether met or MISSED):"]
        for t in report.targets:
            lines.append(f"  {t.name:<38} {t.value:>9.2f} <= {t.limit:<7g} "
                         f"{'met' if t.met else 'MISSED'}")
    else:
        lines += ["", f"targets: not printed (they are goals set for {REFERENCE}; "
                  "this run differs)"]
    lines.append(f"wall {report.wall_s:.1f} s")
    return "\n".join(lines)
