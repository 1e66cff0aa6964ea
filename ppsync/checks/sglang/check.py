"""``ppsync sglang-check``: SGLang's engine at pp_size 2 on a tiny dummy
Llama, without and with ppsync's guard, side by side.

Cases (each one or two bounded engine runs, ppsync.checks.sglang.run):

- ``none``: both runs generate; PASS needs identical tokens and the guard
  active on every stage of the guarded run (and on none of the other).
- ``kill-last`` / ``stop-last``: after a first generate, the last stage's
  scheduler is SIGKILLed / SIGSTOPped and the caller generates again. Both
  runs' outcomes are shown (the error the caller saw, the stage named, the
  seconds from the fault to the end or "still hung after N s", the
  processes left); PASS needs the guarded run to name the last stage
  within its bound (:func:`naming_bound_s`: ``silent_s`` for a stopped
  stage, whose heartbeat stopped; :data:`DEAD_S` for a killed one) +
  :data:`SLACK_S` of the fault and identical first tokens. SGLang's own
  outcome (whether the caller's generate() returns, how soon, what it
  leaves) is reported, not judged: after a scheduler's exception SGLang's
  engine ends its process tree from a signal handler, which does not
  always run while the caller is blocked.
- ``slow-last``: the last stage's scheduler sleeps ``slow_s`` (90 s) before
  one step of the first generate (engine.py, ``PPSYNC_SGLANG_CHECK_SLOW``),
  then the caller generates again: a healthy slow stage. PASS needs both
  runs to end normally with identical tokens of both calls, the stall
  inside the first call in both, and no error from the guard. Run with
  SGLang's and ppsync's defaults unless ``--timeout`` / ``--silent`` set
  the guard's.
- ``desync``: the guarded run with stage 1's own view of proxy message
  :data:`DESYNC_STEP` perturbed (``PPSYNC_SGLANG_PERTURB``); PASS needs a
  DesyncError naming that message and the field ``rids``. With the view
  check off (``view_check=False``, the tests' switch) it must fail.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from pathlib import Path

from ppsync.checks.sglang.engine import ENV_SLOW, FAULT_SIGNALS
from ppsync.checks.sglang.report import Verdict, format_case
from ppsync.checks.sglang.run import (
    STAGE_NAMED,
    RunResult,
    RunSpec,
    run_engine,
    sglang_python,
)
from ppsync.compat.env import ENV_SILENT, ENV_TIMEOUT, Bounds, bounds_from_env

__all__ = ["CASES", "DEAD_S", "DESYNC_STEP", "SLACK_S", "SglangCheckOptions", "judge_desync",
           "judge_fault", "judge_none", "judge_slow", "naming_bound_s", "run_case", "run_check"]

CASES = ("none", "kill-last", "stop-last", "slow-last", "desync")
SLACK_S = 15.0
"""What the guarded run may take past its bound to name the stage: the
board's grace (2 s), SGLang ending its process tree, a loaded machine."""
DEAD_S = 1.0
"""A killed stage is named within about this (its connection closes)."""
SLOW_STEP = 3
"""The last stage's run_batch call that stalls in ``slow-last`` (in the first generate)."""
STALL_MARGIN_S = 0.5
DESYNC_STEP = 2
PROMPTS = [[1, 5, 9, 17, 33], [1, 100, 200, 300], [1, 7, 7, 7, 7, 7]]


@dataclass
class SglangCheckOptions:
    """What ``ppsync sglang-check`` runs."""

    cases: list[str] = field(default_factory=lambda: ["none", "desync"])
    pp_size: int = 2
    timeout_s: float | None = None
    """The guard's PPSYNC_TIMEOUT_S (None: unset, ppsync's default)."""
    silent_s: float | None = None
    """The guard's PPSYNC_SILENT_S (None: unset, ppsync's default)."""
    slow_s: float = 90.0
    """``slow-last``: the last stage's stall in one step."""
    hang_s: float = 60.0
    """How long SGLang alone may go on after a fault before it counts as hung."""
    run_limit_s: float = 600.0
    max_tokens: int = 8
    seed: int = 0
    work_dir: Path = Path("sglang-check-work")
    python: str = field(default_factory=sglang_python)
    view_check: bool = True


def bounds(opts: SglangCheckOptions) -> Bounds:
    """The guard's bounds in the guarded runs (as it reads them)."""
    return bounds_from_env(_bound_vars(opts))


def _bound_vars(opts: SglangCheckOptions) -> dict[str, str]:
    return {name: f"{value:g}" for name, value in ((ENV_TIMEOUT, opts.timeout_s),
                                                   (ENV_SILENT, opts.silent_s))
            if value is not None}


def naming_bound_s(fault: str, silent_s: float) -> float:
    """How long after ``fault`` the guard may take to name the last stage
    (before :data:`SLACK_S`): ``silent_s`` for a stopped one, :data:`DEAD_S`
    for a killed one."""
    return silent_s if fault.startswith("stop") else DEAD_S


def _spec(opts: SglangCheckOptions, name: str, *, guard: bool, fault: str | None = None,
          extra: dict[str, str] | None = None) -> RunSpec:
    env = {"PPSYNC_SGLANG": "1" if guard else "0", **_bound_vars(opts),
           "PPSYNC_DUMP_DIR": str((opts.work_dir / name / "dumps").resolve()),
           "PPSYNC_SGLANG_CHECK": "1" if opts.view_check else "0", **(extra or {})}
    if fault == "slow-last":
        env[ENV_SLOW] = f"{opts.pp_size - 1}:{SLOW_STEP}:{opts.slow_s:g}"
    named = fault is not None and fault in FAULT_SIGNALS
    after = (naming_bound_s(fault, bounds(opts).silent_s) + SLACK_S
             if guard and named and fault is not None else opts.hang_s)
    return RunSpec(name=name, python=opts.python, work_dir=opts.work_dir.resolve(),
                   pp_size=opts.pp_size, prompts=PROMPTS, max_tokens=opts.max_tokens,
                   seed=opts.seed, fault=fault, env=env, after_fault_s=after,
                   limit_s=opts.run_limit_s)


def judge_none(alone: RunResult, guarded: RunResult, pp_size: int) -> Verdict:
    problems = []
    a, g = alone.tokens(0), guarded.tokens(0)
    if not a or not g:
        problems.append("a run produced no tokens")
    elif a != g:
        problems.append(f"tokens differ: SGLang alone {a}, with ppsync {g}")
    if guarded.active_stages() != set(range(pp_size)):
        problems.append(f"guard active on stages {sorted(guarded.active_stages())}, "
                        f"not all {pp_size}")
    if alone.active_stages():
        problems.append("the guard ran in the run without it (PPSYNC_SGLANG=0)")
    if guarded.ppsync_errors():
        problems.append(f"the guard raised: {guarded.ppsync_errors()[0]}")
    return Verdict(not problems, problems)


def judge_fault(alone: RunResult, guarded: RunResult, opts: SglangCheckOptions) -> Verdict:
    problems = []
    last = opts.pp_size - 1
    named = [m for _, _, msg in guarded.ppsync_errors() for m in STAGE_NAMED.finditer(msg)]
    if not any(int(m.group(1)) == last for m in named):
        problems.append(f"ppsync's run did not name PP stage {last}")
    fault = guarded.event("fault")
    kind = str(fault["fault"]) if fault is not None else "stop-last"
    bound = naming_bound_s(kind, bounds(opts).silent_s)
    took = guarded.named_after_fault
    if took is None or took > bound + SLACK_S:
        what = "silent_s" if kind.startswith("stop") else "dead"
        problems.append(f"ppsync's run did not name a stage within {what} {bound:g} + "
                        f"{SLACK_S:g} s = {bound + SLACK_S:g} s of the fault"
                        + ("" if took is None else f" ({took:.1f} s)"))
    a, g = alone.tokens(0), guarded.tokens(0)
    if not a or a != g:
        problems.append(f"first tokens differ or missing: SGLang alone {a}, with ppsync {g}")
    for r in (alone, guarded):
        if r.processes_after_cleanup:
            problems.append(f"{r.name}: {r.processes_after_cleanup} processes survived cleanup")
    return Verdict(not problems, problems)


def judge_slow(alone: RunResult, guarded: RunResult, opts: SglangCheckOptions) -> Verdict:
    """slow-last: both runs ended normally, the stall in the first call of
    each, identical tokens of both calls, no error from the guard."""
    problems = []
    for call in (0, 1):
        a, g = alone.tokens(call), guarded.tokens(call)
        if not a or not g:
            problems.append(f"call {call}: a run produced no tokens (SGLang alone {a}, with "
                            f"ppsync {g})")
        elif a != g:
            problems.append(f"call {call}: tokens differ: SGLang alone {a}, with ppsync {g}")
    for r in (alone, guarded):
        stall = r.event("slow")
        start, end = r.event_where("generate", 0), r.event_where("tokens", 0)
        if stall is None:
            problems.append(f"{r.name}: no stall reported (SLOW_STEP = {SLOW_STEP} not reached?)")
        elif float(stall["seconds"]) < opts.slow_s - STALL_MARGIN_S:
            problems.append(f"{r.name}: the stall lasted {float(stall['seconds']):.1f} s, not "
                            f"{opts.slow_s:g} s")
        elif start is None or end is None or not start["t"] <= stall["t"] <= end["t"]:
            problems.append(f"{r.name}: the stall came outside the first generate call")
        if r.event("shutdown") is None or r.exit_code != 0:
            problems.append(f"{r.name}: did not end normally ({r.caller_error()})")
        if r.processes_after_cleanup:
            problems.append(f"{r.name}: {r.processes_after_cleanup} processes survived cleanup")
    problems += [f"the guard raised on stage {stage}: {kind}: {msg[:300]}"
                 for stage, kind, msg in guarded.ppsync_errors()]
    if guarded.active_stages() != set(range(opts.pp_size)):
        problems.append(f"guard active on stages {sorted(guarded.active_stages())}, "
                        f"not all {opts.pp_size}")
    return Verdict(not problems, problems)


def judge_desync(guarded: RunResult) -> Verdict:
    want = f"proxy message {DESYNC_STEP} "
    hits = [(stage, msg) for stage, kind, msg in guarded.ppsync_errors()
            if kind == "DesyncError" and want in msg and "first differing field rids" in msg]
    problems = [] if hits else [
        f"no DesyncError naming {want.strip()} and field rids (errors: "
        f"{guarded.ppsync_errors() or 'none'})"]
    if guarded.processes_after_cleanup:
        problems.append(f"{guarded.processes_after_cleanup} processes survived cleanup")
    return Verdict(not problems, problems)


def run_case(case: str, opts: SglangCheckOptions) -> tuple[Verdict, str]:
    """Run one case; its verdict and its report."""
    if case == "desync":
        perturb = {"PPSYNC_SGLANG_PERTURB": f"1:proxy:{DESYNC_STEP}"}
        guarded = run_engine(_spec(opts, "desync", guard=True, extra=perturb))
        verdict = judge_desync(guarded)
        return verdict, format_case(case, None, guarded, verdict)
    fault = None if case == "none" else case
    alone = run_engine(_spec(opts, f"{case}-sglang", guard=False, fault=fault))
    guarded = run_engine(_spec(opts, f"{case}-ppsync", guard=True, fault=fault))
    verdict = (judge_none(alone, guarded, opts.pp_size) if fault is None
               else judge_slow(alone, guarded, opts) if fault == "slow-last"
               else judge_fault(alone, guarded, opts))
    return verdict, format_case(case, alone, guarded, verdict)


def run_check(opts: SglangCheckOptions) -> int:
    """Every case of ``opts``: 0 when all pass, 1 when one fails, 2 when
    this interpreter has no SGLang."""
    if importlib.util.find_spec("sglang") is None:
        print("ppsync sglang-check: SGLang is not installed for this python "
              f"({opts.python}); `make sglang-check` builds a venv with it")
        return 2
    ok = True
    for case in opts.cases:
        verdict, text = run_case(case, opts)
        print(text, flush=True)
        ok = ok and verdict.passed
    print(f"sglang-check: {'PASS' if ok else 'FAIL'} ({', '.join(opts.cases)})")
    return 0 if ok else 1
