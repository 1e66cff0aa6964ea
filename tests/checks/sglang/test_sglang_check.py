"""``ppsync sglang-check`` without SGLang: its arguments, what each case's
runs are given (ppsync's default bounds unless set, the slow stage's
variable), the stall on a stand-in scheduler, and the verdicts of the fault
and slow-last cases on recorded runs. The check itself runs SGLang:
tests/compat/test_sglang_engine.py, ``make sglang-check``."""

from __future__ import annotations

import json
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from ppsync.checks.sglang import check, engine
from ppsync.checks.sglang.check import (
    DEAD_S,
    SLACK_S,
    SLOW_STEP,
    SglangCheckOptions,
    bounds,
    judge_fault,
    judge_slow,
    naming_bound_s,
)
from ppsync.checks.sglang.engine import EVENT_PREFIX
from ppsync.checks.sglang.report import format_case
from ppsync.checks.sglang.run import RunResult
from ppsync.cli import main
from ppsync.compat.env import Bounds

TOKENS = [[5, 6, 7], [8, 9]]


def _opts(tmp_path: Path, **kw: Any) -> SglangCheckOptions:
    return SglangCheckOptions(work_dir=tmp_path, python="python", **kw)


def test_cases_run_with_ppsyncs_default_bounds_unless_set(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    seen: list[SglangCheckOptions] = []

    def run_check(opts: SglangCheckOptions) -> int:
        seen.append(opts)
        return 0

    monkeypatch.setattr("ppsync.checks.sglang.run_check", run_check)
    assert main(["sglang-check", "--fault", "slow-last", "--fault", "stop-last"]) == 0
    opts = seen[-1]
    assert (opts.cases, opts.timeout_s, opts.silent_s, opts.slow_s) == (
        ["slow-last", "stop-last"], None, None, 90.0)
    spec = check._spec(_opts(tmp_path, slow_s=90.0), "slow-last-ppsync", guard=True,
                       fault="slow-last")
    assert "PPSYNC_TIMEOUT_S" not in spec.env and "PPSYNC_SILENT_S" not in spec.env
    assert spec.env[engine.ENV_SLOW] == f"1:{SLOW_STEP}:90"
    assert main(["sglang-check", "--fault", "stop-last", "--timeout", "30", "--silent", "4",
                 "--slow", "20"]) == 0
    opts = seen[-1]
    assert bounds(opts) == Bounds(timeout_s=30.0, silent_s=4.0) and opts.slow_s == 20.0
    spec = check._spec(opts, "stop-last-ppsync", guard=True, fault="stop-last")
    assert (spec.env["PPSYNC_TIMEOUT_S"], spec.env["PPSYNC_SILENT_S"]) == ("30", "4")
    assert engine.ENV_SLOW not in spec.env
    assert spec.after_fault_s == 4.0 + SLACK_S  # watched to the stopped stage's bound
    alone = check._spec(opts, "stop-last-sglang", guard=False, fault="stop-last")
    assert alone.after_fault_s == opts.hang_s


def test_a_stopped_stage_is_judged_by_silent_s_a_killed_one_at_once() -> None:
    assert naming_bound_s("stop-last", 15.0) == 15.0
    assert naming_bound_s("kill-last", 15.0) == DEAD_S


def _fault_run(name: str, fault: str, named_after: float | None) -> RunResult:
    run = RunResult(name, events=[{"event": "tokens", "call": 0, "tokens": TOKENS},
                                  {"event": "fault", "fault": fault, "stage": 1, "t": 5.0}])
    if named_after is not None:
        run.named_after_fault = named_after
        run.stderr = ("ppsync: SGLang PP stage 0 (global rank 0): SyncTimeout: SGLang PP stage "
                      "0 (global rank 0): PP stage 1 (global rank 1) is silent: ...\n")
    return run


@pytest.mark.parametrize(("fault", "took", "silent", "passed"), [
    ("stop-last", 19.0, None, True),  # the default silent_s 15 + 15
    ("stop-last", 31.0, None, False),
    ("stop-last", 19.0, 2.0, False),  # PPSYNC_SILENT_S = 2: 2 + 15
    ("kill-last", 3.0, None, True),
    ("kill-last", 16.5, None, False),
    ("stop-last", None, None, False),
])
def test_the_fault_verdict_follows_the_failure_model(
        tmp_path: Path, fault: str, took: float | None, silent: float | None,
        passed: bool) -> None:
    opts = _opts(tmp_path, silent_s=silent)
    verdict = judge_fault(_fault_run("a", fault, None), _fault_run("g", fault, took), opts)
    assert verdict.passed == passed, verdict.problems
    if not passed and took is not None:
        what = "silent_s" if fault == "stop-last" else "dead"
        assert any(p.startswith(f"ppsync's run did not name a stage within {what}")
                   and f"({took:.1f} s)" in p for p in verdict.problems), verdict.problems


def _slow_run(name: str, *, stall: float | None = 90.0, at: float = 12.0,
              tokens1: list[list[int]] = TOKENS, ended: bool = True) -> RunResult:
    events: list[dict[str, Any]] = [
        {"event": "generate", "call": 0, "t": 10.0},
        {"event": "tokens", "call": 0, "tokens": TOKENS, "t": 110.0},
        {"event": "generate", "call": 1, "t": 110.5},
        {"event": "tokens", "call": 1, "tokens": tokens1, "t": 112.0}]
    if stall is not None:
        events.insert(1, {"event": "slow", "stage": 1, "step": SLOW_STEP, "seconds": stall,
                          "t": at})
    if ended:
        events.append({"event": "shutdown", "t": 113.0})
    active = "".join(f"ppsync: guard active on SGLang PP stage {s} of 2\n" for s in (0, 1))
    return RunResult(name, events=events, stderr=active if name.endswith("ppsync") else "",
                     exit_code=0 if ended else None, ended=ended)


def test_slow_last_passes_only_with_the_stall_identical_tokens_and_no_error(
        tmp_path: Path) -> None:
    opts = _opts(tmp_path, slow_s=90.0)
    alone, guarded = _slow_run("slow-last-sglang"), _slow_run("slow-last-ppsync")
    verdict = judge_slow(alone, guarded, opts)
    assert verdict.passed, verdict.problems
    report = format_case("slow-last", alone, guarded, verdict)
    assert "90.0 s on stage 1, before its run_batch 3" in report
    assert report.splitlines()[-1] == "  slow-last: PASS"
    guarded.stderr += ("ppsync: SGLang PP stage 0 (global rank 0): SyncTimeout: SGLang PP stage "
                       "0 (global rank 0): PP stage 1 (global rank 1) is silent: x\n")
    assert judge_slow(alone, guarded, opts).problems == [
        "the guard raised on stage 0: SyncTimeout: SGLang PP stage 0 (global rank 0): PP stage "
        "1 (global rank 1) is silent: x"]
    cases = [
        (_slow_run("slow-last-sglang", stall=None), "slow-last-sglang: no stall reported"),
        (_slow_run("slow-last-sglang", stall=30.0), "slow-last-sglang: the stall lasted 30.0 s"),
        (_slow_run("slow-last-sglang", at=111.0), "slow-last-sglang: the stall came outside"),
        (_slow_run("slow-last-sglang", tokens1=[[5], [8]]), "call 1: tokens differ"),
        (_slow_run("slow-last-sglang", ended=False), "slow-last-sglang: did not end normally"),
    ]
    for run, problem in cases:
        problems = judge_slow(run, _slow_run("slow-last-ppsync"), opts).problems
        assert len(problems) == 1 and problems[0].startswith(problem), problems


def test_the_stall_sleeps_once_before_the_nth_step_of_its_stage_only(
        capsys: pytest.CaptureFixture[str]) -> None:
    steps: list[int] = []

    def run_batch(self: Any, batch: int) -> int:
        steps.append(batch)
        return batch

    slowed = engine.slowed_run_batch(run_batch, 1, 2, 0.3)
    last = SimpleNamespace(pp_group=SimpleNamespace(rank_in_group=1))
    first = SimpleNamespace(pp_group=SimpleNamespace(rank_in_group=0))
    t0 = time.monotonic()
    assert [slowed(first, 1), slowed(first, 2), slowed(last, 3)] == [1, 2, 3]
    assert time.monotonic() - t0 < 0.25
    assert slowed(last, 4) == 4  # the stage's 2nd step: stalls first
    assert time.monotonic() - t0 >= 0.3
    t1 = time.monotonic()
    assert slowed(last, 5) == 5
    assert time.monotonic() - t1 < 0.25 and steps == [1, 2, 3, 4, 5]
    (line,) = capsys.readouterr().out.splitlines()
    event = json.loads(line.removeprefix(EVENT_PREFIX))
    assert (event["event"], event["stage"], event["step"]) == ("slow", 1, 2)
    assert event["seconds"] >= 0.3
