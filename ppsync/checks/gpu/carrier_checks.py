"""``make gpu-check``'s checks of the host carrier, the default (n-p;
docs/design.md, "The carrier"; the table: ppsync.checks.gpu.check). Every
rank sits on GPU 0 and its token group is gloo: the frames go through
pinned memory, as they do by default on a GPU.

n) P = 2 and 3, the workload (ppsync.harness.driver, as check a runs it) at
   K = 0 and 3: exact delivery; in each rank process no copy waited on and
   no pinned buffer taken early (ppsync.core.codec.carriers.STATS), and at
   least one host carrier built (else the frames went another way); every
   token-path call of the engine's thread under
   ``torch.cuda.set_sync_debug_mode("error")``, so any synchronizing call
   raises (the watcher, which pumps between calls, only queries events).
o) a torch.profiler trace (CPU and CUDA activity) of fixed steps on each
   rank: no device kernel whose name contains "nccl"; the kernels seen
   are counted (none seen: the trace showed nothing, a failure).
p) P = 2 and 3, a compute-bound loop on the main stream (one matmul per
   step; the host at most one step ahead of the device, as an engine that
   reads the previous step's tokens): blocks with the token path's calls
   alternate with blocks without, barrier-aligned across ranks, and the
   median ratio of paired blocks must stay within :data:`RATIO_LIMIT` on
   every rank (ratios only: no absolute time is judged).

One rank function, :func:`carrier_rank`, runs whichever parts its
:class:`Plan` names; each check spawns its own ranks. The verdicts are
pure functions of what the ranks return. On CPU (the tests' dry run) a
plan with ``twin_lag_s`` runs the ranks on the CPU twin of a device with
the host carrier (ppsync.core.wire.completion.emulate): stand-in streams
whose copies end late, so sends are deferred as on a GPU.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ppsync.bench.common import FixedStep, fixed_step
from ppsync.checks.gpu.step_costs import sync_guard_live
from ppsync.checks.gpu.stream_checks import device_of
from ppsync.checks.gpu.workload_checks import delivered_exactly, no_host_sync
from ppsync.core.codec.carriers import STATS as COPY_STATS
from ppsync.core.path.token_path import TokenPath
from ppsync.core.wire.completion import emulate
from ppsync.core.wire.groups import token_group
from ppsync.errors import RankFailed
from ppsync.harness.driver import run_sync_rank, workload_config
from ppsync.harness.launcher import RankEnv, spawn_ranks
from ppsync.schemas.config import SyncConfig

TIMEOUT_S = 30.0
"""The token paths' timeout_s (and each launch's bound: timeout_s + 10)."""
STEPS = 2000
"""n's workload steps per configuration (K = 0, K = 3; P = 2, P = 3)."""
RATIO_LIMIT = 1.02
"""p: the loop with the token path over the loop without it, at most, per rank."""
ROWS = 64
Result = dict[str, Any]
COUNTED = ("copy_waits", "reused_early", "built", "deferred")


@dataclass(frozen=True)
class Plan:
    """What :func:`carrier_rank` runs (a part with a count of 0 is not run)."""

    steps: int = 0
    """n: workload steps per K of ``ks``."""
    ks: tuple[int, ...] = (0, 3)
    profile_steps: int = 0
    """o: fixed steps profiled (after 5 unprofiled ones)."""
    pairs: int = 0
    """p: pairs of blocks, one with the token path and one without."""
    block_steps: int = 16
    size: int = 4096
    """p: the matmul's side on CUDA (float32: a few ms a step on an H100)."""
    twin_lag_s: float | None = None
    """The CPU dry run: the token group runs as the twin of a device with
    the host carrier, its stand-in streams this far behind the host."""


def copy_stats() -> dict[str, int]:
    """The host carriers' counts in this process so far."""
    return {k: int(getattr(COPY_STATS, k)) for k in COUNTED}


def _since(before: dict[str, int]) -> dict[str, int]:
    now = copy_stats()
    return {k: now[k] - before[k] for k in COUNTED}


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def host_path(plan: Plan, env: RankEnv, dev: torch.device, k: int) -> TokenPath:
    """A token path with the host carrier on a new gloo token group."""
    config = SyncConfig.build(pp_size=env.world_size, max_num_reqs=ROWS,
                              num_speculative_steps=k, timeout_s=TIMEOUT_S, codec="device",
                              carrier="host")
    group = token_group(dist.group.WORLD, timeout_s=TIMEOUT_S,  # type: ignore[arg-type]
                        backend="gloo")
    if plan.twin_lag_s is not None:
        emulate(group, "nccl", carrier="host", lag_s=plan.twin_lag_s)
    return TokenPath(config, group, device=dev)


def path_step(path: TokenPath, step: FixedStep) -> bool:
    """One engine step's token-path calls; whether a frame was released."""
    if path.is_last:
        path.publish(step.view, step.sampled())
        return False
    released = path.consume()
    path.post(step.view)
    return released is not None


def end_path(path: TokenPath) -> None:
    """Receivers take the D steps still posted, then every rank closes."""
    if not path.is_last:
        for _ in range(path.config.depth):
            path.consume()
    path.close()


# -- the parts ---------------------------------------------------------------------------


def workload_part(plan: Plan, env: RankEnv, dev: torch.device, k: int) -> Result:
    """n at one K: the workload, every token-path call under sync debug "error"."""
    before = copy_stats()
    path = host_path(plan, env, dev, k)
    found: list[str] = []
    report = run_sync_rank(path, workload_config(path.config, steps=plan.steps, seed=13 + k),
                           hot=functools.partial(no_host_sync, "error", found))
    return {"k": k, "exact": delivered_exactly(report), "rows": report.rows_delivered,
            "sent": report.rows_sent, "syncs": found[:3], "copies": _since(before)}


def device_activity(events: Iterable[tuple[str, bool]]) -> Result:
    """From a profile's (name, ran on the device) events: the device kernels
    seen, the copies and sets (Memcpy, Memset), and the kernels whose name
    says NCCL (case-insensitive)."""
    on_device = [name for name, device in events if device]
    copies = [n for n in on_device if n.lower().startswith(("memcpy", "memset"))]
    kernels = [n for n in on_device if not n.lower().startswith(("memcpy", "memset"))]
    nccl = [n for n in kernels if "nccl" in n.lower()]
    return {"kernels": len(kernels), "copies": len(copies), "nccl": len(nccl),
            "nccl_names": sorted(set(nccl))[:3]}


def profile_part(plan: Plan, env: RankEnv, dev: torch.device) -> Result:
    """o: fixed steps with the token path under torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    path = host_path(plan, env, dev, 3)
    step = fixed_step(ROWS, 3).to(dev)
    for _ in range(5):  # lazy initialisation and compilation stay out of the trace
        path_step(path, step)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda"
                                           else [])
    with profile(activities=activities) as prof:
        for _ in range(plan.profile_steps):
            path_step(path, step)
        _sync(dev)
    end_path(path)
    seen = device_activity((e.name, e.device_type.name == "CUDA") for e in prof.events())
    return {**seen, "steps": plan.profile_steps}


def _bound(dev: torch.device, prev: Any) -> Any:
    """The host stays at most one step ahead: wait for the previous step's
    event (an engine reading that step's tokens), record this one's."""
    if dev.type != "cuda":
        return None
    event = torch.cuda.Event()  # type: ignore[no-untyped-call]
    event.record()
    if prev is not None:
        prev.synchronize()
    return event


def ratio_part(plan: Plan, env: RankEnv, dev: torch.device) -> Result:
    """p: paired blocks of the matmul loop, with and without the token path's
    calls, in alternating order; each block's seconds from a synchronized
    start (every rank past a barrier) to its synchronized end."""
    before = copy_stats()
    path = host_path(plan, env, dev, 3)
    step = fixed_step(ROWS, 3).to(dev)
    n = plan.size if dev.type == "cuda" else 64  # the dry run: the logic, not the load
    a = torch.randn(n, n, device=dev)
    c = torch.empty_like(a)
    released = 0

    def block(with_path: bool) -> float:
        nonlocal released
        _sync(dev)
        dist.barrier()
        t0 = time.perf_counter()
        prev = None
        for _ in range(plan.block_steps):
            if with_path and not path.is_last:
                released += path.consume() is not None
            torch.mm(a, a, out=c)
            if with_path:
                if path.is_last:
                    path.publish(step.view, step.sampled())
                else:
                    path.post(step.view)
            prev = _bound(dev, prev)
        _sync(dev)
        return time.perf_counter() - t0

    block(True)  # warm-up, not counted
    block(False)
    with_s: list[float] = []
    without_s: list[float] = []
    for i in range(plan.pairs):
        for with_path in ((True, False) if i % 2 == 0 else (False, True)):
            (with_s if with_path else without_s).append(block(with_path))
    end_path(path)
    return {"with_s": with_s, "without_s": without_s, "released": released,
            "step_ms": statistics.median(without_s) / plan.block_steps * 1e3,
            "copies": _since(before)}


def carrier_rank(plan: Plan, env: RankEnv) -> Result:
    """One rank of n, o and p: the parts ``plan`` names, in that order, each
    on a token path of its own; every rank on GPU 0 (CPU in the dry run)."""
    dev = device_of(0)
    out: Result = {"rank": env.rank, "last": env.rank == env.world_size - 1}
    if plan.steps:
        out["workload"] = [workload_part(plan, env, dev, k) for k in plan.ks]
    if plan.profile_steps:
        out["profile"] = profile_part(plan, env, dev)
    if plan.pairs:
        out["ratio"] = ratio_part(plan, env, dev)
    return out


# -- the verdicts ------------------------------------------------------------------------


def workload_faults(w: Result) -> list[str]:
    """What is wrong with one rank's workload result at one K (n)."""
    copies = w["copies"]
    return [what for what, wrong in (
        ("not exact", not w["exact"]),
        ("no host carrier built (its frames went another way)", copies["built"] < 1),
        (f"{copies['copy_waits']} copy waits", copies["copy_waits"]),
        (f"{copies['reused_early']} pinned buffers reused early", copies["reused_early"]),
        (f"synchronizing calls {w['syncs']}", w["syncs"])) if wrong]


def workload_verdict(runs: dict[int, list[Result]], steps: int) -> tuple[bool, str]:
    """n: every rank of every run exact at every K, a host carrier built
    (the premise: frames went through pinned memory), no copy waited on,
    no pinned buffer taken early, no synchronizing call found."""
    ok, parts, deferred = True, [], 0
    for P, ranks in runs.items():
        for at in range(len(ranks[0]["workload"])):
            per = [(r["rank"], r["workload"][at]) for r in ranks]
            bad = [f"rank {rank}: {', '.join(workload_faults(w))}" for rank, w in per
                   if workload_faults(w)]
            ok &= not bad
            deferred += sum(w["copies"]["deferred"] for _, w in per)
            rows = max(w["rows"] for _, w in per)
            parts.append(f"P={P} K={per[0][1]['k']}: "
                         + ("; ".join(bad) if bad else f"{rows} rows exact"))
    return ok, (f"host carrier, {steps} steps each, every token-path call under sync debug "
                "'error': " + " | ".join(parts) + "; copy waits, pinned buffers reused early: "
                + ("0 on every rank" if ok else "see above")
                + f"; {deferred} sends deferred to a later pump")


def profile_verdict(ranks: list[Result]) -> tuple[bool, str]:
    """o: on every rank the trace saw device kernels (the premise) and none
    of them NCCL's."""
    premise = all(r["profile"]["kernels"] > 0 for r in ranks)
    ok = premise and not any(r["profile"]["nccl"] for r in ranks)
    seen = "; ".join(f"rank {r['rank']}: {r['profile']['kernels']} kernels, "
                     f"{r['profile']['copies']} copies, {r['profile']['nccl']} NCCL"
                     + (f" {r['profile']['nccl_names']}" if r["profile"]["nccl"] else "")
                     for r in ranks)
    note = "" if premise else "premise FALSE (a rank's trace saw no device kernel); "
    return ok, (f"{note}host carrier, {ranks[0]['profile']['steps']} steps profiled per "
                f"rank: {seen}")


def paired_ratio(with_s: list[float], without_s: list[float]) -> float:
    """The median over block pairs of (with the token path) / (without)."""
    return statistics.median(w / wo for w, wo in zip(with_s, without_s, strict=True))


def ratio_verdict(runs: dict[int, list[Result]], limit: float = RATIO_LIMIT
                  ) -> tuple[bool, str]:
    """p: on every rank of every run the paired ratio is at most ``limit``,
    and every receiver got frames during the blocks with the token path
    (the premise: the path ran there)."""
    ok, parts = True, []
    for P, ranks in runs.items():
        seen = []
        for r in ranks:
            res = r["ratio"]
            ratio = paired_ratio(res["with_s"], res["without_s"])
            ran = r["last"] or res["released"] > 0
            ok &= ratio <= limit and ran
            seen.append(f"rank {r['rank']} {ratio:.3f}x" + ("" if ran else " (no frame)"))
        step_ms = max(r["ratio"]["step_ms"] for r in ranks)
        waits = sum(r["ratio"]["copies"]["copy_waits"] for r in ranks)
        parts.append(f"P={P} ({step_ms:.1f} ms/step, {waits} copy waits): " + ", ".join(seen))
    return ok, (f"host carrier, matmul loop with / without the token path (median of "
                f"paired blocks; limit {limit:.2f}x): " + " | ".join(parts))


# -- the checks, as gpu_check's table runs them ---------------------------------------------


def _spawn(plan: Plan, P: int) -> list[Result]:
    return spawn_ranks(functools.partial(carrier_rank, plan), P, timeout_s=TIMEOUT_S,
                       start_method="spawn")


def check_n(steps: int = STEPS) -> tuple[bool, str]:
    if not sync_guard_live(device_of(0)):
        return False, "sync debug mode 'error' let a .item() through: n could not fail"
    try:
        runs = {P: _spawn(Plan(steps=steps), P) for P in (2, 3)}
    except RankFailed as e:
        if "synchroniz" not in str(e):
            raise
        return False, f"a synchronizing call in a token-path call (sync debug 'error'): {e}"
    return workload_verdict(runs, steps)


def check_o(steps: int = 50) -> tuple[bool, str]:
    return profile_verdict(_spawn(Plan(profile_steps=steps), 2))


def check_p(pairs: int = 10) -> tuple[bool, str]:
    return ratio_verdict({P: _spawn(Plan(pairs=pairs), P) for P in (2, 3)})


# -- the summary's line on the default carrier --------------------------------------------

SHOWS = {
    "n": "a copy waited on, a pinned buffer reused early or a synchronizing call",
    "o": "an NCCL kernel",
    "p": f"a matmul loop slowed beyond {RATIO_LIMIT:.2f}x by the token path",
}
"""What each of n, o, p would show against the host carrier, were it to fail."""


def carrier_line(rows: list[tuple[str, str, str, float]]) -> str:
    """One line: what this run's rows n, o, p say of the host carrier as the
    default, and what a GPU run would have to show to change it."""
    status = {name[0]: result for name, result, _, _ in rows if name[:1] in SHOWS}
    failed = [k for k in SHOWS if status.get(k) == "FAIL"]
    unrun = [k for k in SHOWS if status.get(k, "SKIP") == "SKIP"]
    change = ("; ".join(f"{SHOWS[k]} ({k})" for k in SHOWS)
              + "; or, with >= 2 GPUs, the device carrier beating it on p's ratio "
              "(not measured here)")
    if failed:
        said = "; ".join(f"{k} failed: {SHOWS[k]}" for k in failed)
        return (f"carrier: {said}: this run is evidence against the host carrier as the "
                "default; reconsider it (docs/design.md, 'The carrier')")
    if unrun:
        return (f"carrier: {', '.join(unrun)} not run: this run neither confirms nor changes "
                f"the host carrier as the default; it would change on {change}")
    return (f"carrier: the host carrier stays the default (n, o, p passed) unless a GPU run "
            f"shows {change}")
