"""``ppsync vllm-check --fault slow-last|idle``: the healthy twins of the
faults. Slow is not dead (docs/design.md, "The failure model"): an engine
that is slow or idle, but alive, must never be ended by ppsync.

- ``slow-last``: the last PP worker's ``execute_model`` sleeps ``slow_s``
  (90 s by default) before its ``fault_after``-th model step of the first
  generate call (the worker hooks' ``PPSYNC_VLLM_CHECK_SLOW``): a healthy
  stage whose one step takes far longer than ``silent_s`` (its watcher
  thread beats on) and than the waits' start-up bounds, well under vLLM's
  own ``VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS`` (300 s).
- ``idle``: the engine generates, idles ``idle_s`` (180 s by default) with
  no request, its processes alive, then generates again (with ``--spec K``
  a receiver has receives posted while it idles).

Each runs once with vLLM's own handler and once with ppsync's, with
ppsync's default bounds unless ``--handler-timeout`` / ``--handler-silent``
set them. ppsync's run passes only when both runs end normally with
identical tokens (and, with K > 0, drafts accepted: report.failures), the
stall or the idle really happened inside the run as asked, and ppsync's
run recorded no handler error, had no worker leave (the plugin's line) or
die (vLLM's executor's line).
"""

from __future__ import annotations

import re
from pathlib import Path

from ppsync.checks.vllm import worker_hooks
from ppsync.checks.vllm.report import RunResult
from ppsync.compat.vllm.versions import release_of

__all__ = ["HEALTHY", "STALL_MARGIN_S", "healthy_env", "healthy_failures", "healthy_lines",
           "healthy_spec", "idle_note"]

HEALTHY = ("slow-last", "idle")
STALL_MARGIN_S = 0.5
"""How much shorter than asked a recorded stall or idle may be (clock reads)."""
WORKER_DIED = re.compile(r"Worker proc \S+ died unexpectedly")
WORKER_LEFT = re.compile(r"this worker exits \(status \d+")
FIRST_HELD_RELEASE = (0, 33)
"""The first vLLM release whose runner skips broadcast_drafts in a step
that proposed no drafts (so a held step can outlive its engine step)."""


def healthy_env(fault: str, pp_size: int, after: int, slow_s: float) -> dict[str, str]:
    """The worker hooks' variables for ``fault`` (none for ``idle``)."""
    if fault == "slow-last":
        return {worker_hooks.ENV_SLOW: f"{pp_size - 1}:{after}:{slow_s:g}"}
    return {}


def healthy_spec(fault: str, idle_s: float) -> dict[str, object]:
    """What the engine child's spec adds for ``fault`` (the idle between calls)."""
    return {"idle_s": idle_s} if fault == "idle" else {}


def _stall(run: RunResult, pp_size: int) -> tuple[float, float, int] | None:
    return next((w.slow for w in run.workers if w.pp_rank == pp_size - 1 and w.slow), None)


def _call_of(run: RunResult, t: float) -> int | None:
    """The generate call under way at ``t`` (None: none was)."""
    return next((i for i, (a, b) in enumerate(run.calls_at) if a <= t <= b), None)


def _idled_s(run: RunResult) -> float | None:
    """From the end of the first generate call to the start of the second."""
    if len(run.calls_at) < 2:
        return None
    return run.calls_at[1][0] - run.calls_at[0][1]


def _log_lines(run: RunResult, pattern: re.Pattern[str]) -> list[str]:
    if run.log is None or not Path(run.log).exists():
        return []
    return [line.strip() for line in Path(run.log).read_text(errors="replace").splitlines()
            if pattern.search(line)]


def healthy_failures(run: RunResult, fault: str, pp_size: int, slow_s: float,
                     idle_s: float) -> list[str]:
    """Why ``run`` of a healthy ``fault`` fails beyond the tokens (empty:
    it did not). Any run: the stall or the idle happened as asked; ppsync's
    run: also no handler error, no worker left or died."""
    if run.error is not None:
        return []  # report.failures says it did not finish
    out = []
    label = f"{run.label}, {fault}"
    if fault == "slow-last":
        stall = _stall(run, pp_size)
        if stall is None:
            out.append(f"{label}: PP rank {pp_size - 1} recorded no stall (it never reached "
                       "the step asked: fewer model steps than --fault-after?)")
        elif stall[1] < slow_s - STALL_MARGIN_S:
            out.append(f"{label}: PP rank {pp_size - 1} stalled {stall[1]:.1f} s, not "
                       f"{slow_s:g} s")
        elif _call_of(run, stall[0]) is None:
            out.append(f"{label}: PP rank {pp_size - 1}'s stall came outside every generate "
                       "call (vLLM's warm-up?): the pipeline was not waiting on it")
    else:
        idled = _idled_s(run)
        if idled is None or idled < idle_s - STALL_MARGIN_S:
            out.append(f"{label}: the engine idled "
                       f"{'never' if idled is None else f'{idled:.1f} s'}, not {idle_s:g} s")
    if not run.expect_ppsync:
        return out
    for w in run.workers:
        for _, call, typ, line in w.errors:
            out.append(f"{label}: PP rank {w.pp_rank}'s {call} raised {typ}: {line[:200]}")
    out += [f"{label}: a worker left: {line[:240]}" for line in _log_lines(run, WORKER_LEFT)]
    out += [f"{label}: {line[:240]}" for line in _log_lines(run, WORKER_DIED)]
    return out


def idle_note(version: str | None, spec: int) -> str:
    """What the idle run can show with this vLLM and K."""
    if spec == 0:
        return ("K = 0: no step is held for drafts; the run shows an idle engine whose "
                "receivers' watchers see a live last rank is not ended")
    if version is not None and release_of(version) < FIRST_HELD_RELEASE:
        return (f"vLLM {version} calls broadcast_drafts at every step when K > 0, so the last "
                "rank's step held for its drafts never outlives its engine step here: the "
                "held-step idle failure (vLLM 0.33/0.34 skip broadcast_drafts in a step "
                "without drafts, and the engine then goes idle) cannot show with this vLLM; "
                "this run shows an idle engine with receives posted is not ended")
    return (f"vLLM {version or '?'} calls broadcast_drafts only in a step that proposed "
            "drafts: a step held for its drafts before the idle goes from the last rank's "
            "watcher once its engine step returned")


def healthy_lines(runs: tuple[RunResult, RunResult], fault: str, pp_size: int,
                  version: str | None, spec: int) -> list[str]:
    """The report's section on the stall or the idle, per run."""
    lines = []
    if fault == "slow-last":
        lines.append(f"slow-last: PP rank {pp_size - 1}'s execute_model slept in one model step "
                     "of the first generate call:")
        for run in runs:
            stall = _stall(run, pp_size)
            if stall is None:
                lines.append(f"  {run.label}: no stall recorded")
                continue
            t, seconds, step = stall
            call = _call_of(run, t)
            where = ("outside every generate call" if call is None else
                     f"{t - run.calls_at[call][0]:.1f} s into generate call {call}")
            lines.append(f"  {run.label}: {seconds:.1f} s at its model step {step}, {where}")
    else:
        lines.append("idle: the engine idled between generate calls 0 and 1, alive, no request:")
        for run in runs:
            idled = _idled_s(run)
            lines.append(f"  {run.label}: "
                         + ("no second call" if idled is None else f"{idled:.1f} s"))
        lines.append(f"  note: {idle_note(version, spec)}")
    for run in runs:
        if run.expect_ppsync and run.error is None:
            errors = sum(len(w.errors) for w in run.workers)
            left = len(_log_lines(run, WORKER_LEFT)) + len(_log_lines(run, WORKER_DIED))
            lines.append(f"  {run.label}: {errors} handler errors recorded, {left} workers "
                         "left or died")
    return lines
