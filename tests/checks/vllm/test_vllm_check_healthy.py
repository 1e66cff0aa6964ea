"""vllm-check's healthy faults (slow-last, idle) without vLLM: their
arguments, the slow hook on a stand-in runner call, what a run records and
the verdicts (a stall or idle that did not happen, a ppsync error, a worker
that left or died), the report, and the check's exit status around
stand-in runs."""

from __future__ import annotations

import json
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from ppsync.checks.vllm import check, worker_faults, worker_hooks
from ppsync.checks.vllm.healthy import (
    healthy_env,
    healthy_failures,
    healthy_lines,
    healthy_spec,
    idle_note,
)
from ppsync.checks.vllm.options import VllmCheckOptions
from ppsync.checks.vllm.report import RunResult, WorkerRecord, format_report
from ppsync.checks.vllm.runs import result_of
from ppsync.cli import main

OURS = "ppsync.compat.vllm.plugin.VllmPPHandler032"
TOKENS = (((5, 6, 7), (8, 9, 10)), ((5, 6, 7), (8, 9, 10)))
CALLS_AT = ((1000.0, 1100.0), (1100.5, 1110.0))  # call 0 holds the stall at 1010


def _worker(rank: int, ppsync: bool, **kw: Any) -> WorkerRecord:
    return WorkerRecord(pid=100 + rank, pp_rank=rank, pp_size=2, runner="R",
                        handler=OURS if ppsync else "vllm.PPHandler", ppsync=ppsync, **kw)


def _run(ppsync: bool, tmp_path: Path, *, slow: tuple[float, float, int] | None = (
        1010.0, 90.0, 4), errors: tuple[tuple[float, str, str, str], ...] = (),
         calls_at: tuple[tuple[float, float], ...] = CALLS_AT, log: str = "") -> RunResult:
    path = tmp_path / f"vllm-{ppsync}.log"
    path.write_text(log)
    return RunResult("ppsync's plugin" if ppsync else "vLLM's PPHandler", ppsync,
                     (_worker(0, ppsync, errors=errors), _worker(1, ppsync, slow=slow)),
                     TOKENS, (100.0, 9.5), log=str(path), calls_at=calls_at)


def _opts(argv: list[str], monkeypatch: pytest.MonkeyPatch) -> VllmCheckOptions:
    seen: list[VllmCheckOptions] = []

    def run_check(opts: VllmCheckOptions) -> int:
        seen.append(opts)
        return 0

    monkeypatch.setattr("ppsync.checks.vllm.run_check", run_check)
    assert main(["vllm-check", *argv]) == 0
    return seen[0]


def test_healthy_faults_run_as_the_plain_check_with_ppsyncs_defaults(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    opts = _opts(["--fault", "slow-last"], monkeypatch)
    assert (opts.fault, opts.calls, opts.max_tokens, opts.slow_s, opts.fault_after) == (
        "slow-last", 2, 12, 90.0, 4)
    assert (opts.handler_timeout_s, opts.handler_silent_s) == (None, None)
    env = check._base_env(tmp_path, opts, standin=False, cpu=True)
    assert "PPSYNC_TIMEOUT_S" not in env and "PPSYNC_SILENT_S" not in env  # the defaults
    assert env[worker_hooks.ENV_SLOW] == "1:4:90"
    opts = _opts(["--fault", "idle", "--spec", "3", "--idle", "20", "--pp-size", "3"],
                 monkeypatch)
    assert (opts.idle_s, opts.calls, opts.max_tokens, opts.spec) == (20.0, 2, 32, 3)
    env = check._base_env(tmp_path, opts, standin=False, cpu=True)
    assert worker_hooks.ENV_SLOW not in env
    assert healthy_spec("idle", 20.0) == {"idle_s": 20.0} and healthy_spec("slow-last", 1) == {}
    assert healthy_env("slow-last", 3, 2, 0.5) == {worker_hooks.ENV_SLOW: "2:2:0.5"}


@pytest.mark.parametrize(("argv", "message"), [
    (["--slow", "5"], "--slow = 5 needs --fault slow-last"),
    (["--fault", "kill-last", "--slow", "5"], "--slow = 5 needs --fault slow-last"),
    (["--fault", "slow-last", "--idle", "5"], "--idle = 5 needs --fault idle"),
    (["--fault", "idle", "--calls", "1"], "--fault idle needs --calls >= 2"),
    (["--fault", "slow-last", "--nodes", "2"], "--fault slow-last is a worker's fault of the "
     "one-host check"),
    (["--fault", "idle", "--repeat", "2"], "--fault and --repeat: one at a time"),
])
def test_healthy_fault_arguments_that_do_not_go_together_exit_2(
        argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["vllm-check", *argv]) == 2
    assert message in capsys.readouterr().err


def test_the_slow_hook_stalls_the_nth_model_step_of_its_rank_once(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(worker_hooks.ENV_SLOW, "1:2:0.3")
    calls: list[object] = []

    def execute_model(scheduler_output: object, *args: object, **kwargs: object) -> str:
        calls.append(scheduler_output)
        return "ran"

    rec = tmp_path / "worker-1.jsonl"
    with rec.open("w") as out:
        assert worker_faults.slow_for(0, execute_model, out) is None  # another rank's
        slowed = worker_faults.slow_for(1, execute_model, out)
        assert slowed is not None
        step = SimpleNamespace(total_num_scheduled_tokens=4)
        empty = SimpleNamespace(total_num_scheduled_tokens=0)
        t0 = time.monotonic()
        assert slowed(step, dummy_run=True) == "ran"  # a dummy run is no model step
        assert slowed(empty) == "ran"  # nothing scheduled: no model step
        assert slowed(step) == "ran"
        assert time.monotonic() - t0 < 0.25
        assert slowed(step, None) == "ran"  # the 2nd model step: stalls first
        assert time.monotonic() - t0 >= 0.3
        t1 = time.monotonic()
        assert slowed(step) == "ran"  # once
        assert time.monotonic() - t1 < 0.25
    assert len(calls) == 5
    (event,) = [json.loads(line) for line in rec.read_text().splitlines()]
    assert event["event"] == "slow" and event["step"] == 2 and event["s"] >= 0.3


def test_a_runs_records_carry_the_stall_and_the_calls_times(tmp_path: Path) -> None:
    records = tmp_path / "records"
    records.mkdir()
    head = {"event": "handler", "pid": 7, "pp_rank": 1, "pp_size": 2, "runner": "R",
            "handler": OURS, "ppsync": True}
    slow = {"event": "slow", "t": 1010.0, "s": 90.01, "step": 4}
    (records / "worker-7.jsonl").write_text(json.dumps(head) + "\n" + json.dumps(slow) + "\n")
    (tmp_path / "result.json").write_text(json.dumps(
        {"tokens": [[[5]]], "generate_s": [100.0], "calls_at": [[1000.0, 1100.0]]}))
    run = result_of("ppsync's plugin", True, tmp_path, None)
    assert run.calls_at == ((1000.0, 1100.0),)
    assert run.workers[0].slow == (1010.0, 90.01, 4)


def test_slow_last_passes_only_when_the_stall_came_inside_a_call_and_nothing_failed(
        tmp_path: Path) -> None:
    assert healthy_failures(_run(True, tmp_path), "slow-last", 2, 90.0, 180.0) == []
    assert healthy_failures(_run(True, tmp_path, slow=None), "slow-last", 2, 90.0, 180.0) == [
        "ppsync's plugin, slow-last: PP rank 1 recorded no stall (it never reached the step "
        "asked: fewer model steps than --fault-after?)"]
    assert healthy_failures(_run(False, tmp_path, slow=(1010.0, 40.0, 4)), "slow-last", 2,
                            90.0, 180.0) == [
        "vLLM's PPHandler, slow-last: PP rank 1 stalled 40.0 s, not 90 s"]
    assert healthy_failures(_run(True, tmp_path, slow=(990.0, 90.0, 4)), "slow-last", 2,
                            90.0, 180.0) == [
        "ppsync's plugin, slow-last: PP rank 1's stall came outside every generate call "
        "(vLLM's warm-up?): the pipeline was not waiting on it"]
    error = (1070.0, "get_prev_sampled_outputs", "SyncTimeout", "silent peer rank(s) 1")
    log = ("(EngineCore pid=9) ERROR ppsync: PP rank 0 (global rank 0): its watcher raised "
           "SyncTimeout: x; this worker exits (status 70; PPSYNC_VLLM_ON_ERROR=exit) so that\n"
           "(EngineCore pid=9) ERROR Worker proc VllmWorker-0 died unexpectedly, shutting down\n")
    assert healthy_failures(_run(True, tmp_path, errors=(error,), log=log), "slow-last", 2,
                            90.0, 180.0) == [
        "ppsync's plugin, slow-last: PP rank 0's get_prev_sampled_outputs raised SyncTimeout: "
        "silent peer rank(s) 1",
        "ppsync's plugin, slow-last: a worker left: (EngineCore pid=9) ERROR ppsync: PP rank 0 "
        "(global rank 0): its watcher raised SyncTimeout: x; this worker exits (status 70; "
        "PPSYNC_VLLM_ON_ERROR=exit) so that",
        "ppsync's plugin, slow-last: (EngineCore pid=9) ERROR Worker proc VllmWorker-0 died "
        "unexpectedly, shutting down"]
    # vLLM's own run is judged only on the stall it was asked for
    assert healthy_failures(_run(False, tmp_path, errors=(error,), log=log), "slow-last", 2,
                            90.0, 180.0) == []
    # a run that did not finish is report.failures' to name
    unfinished = RunResult("ppsync's plugin", True, error="exit status 1")
    assert healthy_failures(unfinished, "slow-last", 2, 90.0, 180.0) == []


def test_idle_passes_only_when_the_engine_idled_as_long_as_asked(tmp_path: Path) -> None:
    idled = ((1000.0, 1010.0), (1190.0, 1200.0))
    assert healthy_failures(_run(True, tmp_path, calls_at=idled), "idle", 2, 90.0, 180.0) == []
    assert healthy_failures(_run(True, tmp_path, calls_at=idled), "idle", 2, 90.0, 181.0) == [
        "ppsync's plugin, idle: the engine idled 180.0 s, not 181 s"]
    assert healthy_failures(_run(True, tmp_path, calls_at=idled[:1]), "idle", 2, 90.0,
                            180.0) == ["ppsync's plugin, idle: the engine idled never, not 180 s"]


def test_idle_note_says_what_this_vllm_can_show() -> None:
    assert "cannot show with this vLLM" in idle_note("0.32.0", 3)
    assert "calls broadcast_drafts at every step" in idle_note("0.32.0", 3)
    assert "goes from the last rank's watcher" in idle_note("0.34.0", 3)
    assert idle_note("0.32.0", 0).startswith("K = 0: no step is held for drafts")


def test_the_report_shows_the_stall_and_its_verdict_ends_it(tmp_path: Path) -> None:
    base, ours = _run(False, tmp_path), _run(True, tmp_path)
    section = healthy_lines((base, ours), "slow-last", 2, "0.32.0", 0)
    assert section == [
        "slow-last: PP rank 1's execute_model slept in one model step of the first generate "
        "call:",
        "  vLLM's PPHandler: 90.0 s at its model step 4, 10.0 s into generate call 0",
        "  ppsync's plugin: 90.0 s at its model step 4, 10.0 s into generate call 0",
        "  ppsync's plugin: 0 handler errors recorded, 0 workers left or died"]
    report = format_report(base, ours, 2, section=section, passed_also=", through slow-last")
    assert "\n".join(section) in report
    assert report.splitlines()[-1].endswith("identical to vLLM's own handler's, through "
                                            "slow-last")
    report = format_report(base, ours, 2, section=section, more_failures=["it broke"])
    assert report.splitlines()[-2:] == ["FAIL", "  it broke"]
    idle = healthy_lines((base, ours), "idle", 2, "0.32.0", 3)
    assert idle[1] == "  vLLM's PPHandler: 0.5 s" and idle[3].startswith("  note: vLLM 0.32.0")


@pytest.mark.parametrize(("ours_kw", "base_error", "status"), [
    ({}, None, 0),
    ({"slow": None}, None, 1),
    ({"errors": ((1070.0, "receive", "PeerLost", "lost peer rank(s) 1"),)}, None, 1),
    ({}, "exit status 1", 2),
])
def test_the_healthy_check_exits_by_both_runs(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str],
        ours_kw: dict[str, Any], base_error: str | None, status: int) -> None:
    def run_engine(label: str, ppsync: bool, *args: object) -> RunResult:
        run = _run(ppsync, tmp_path, **(ours_kw if ppsync else {}))
        return run if ppsync or base_error is None else RunResult(label, False,
                                                                  error=base_error)

    monkeypatch.setattr(check, "run_engine", run_engine)
    opts = VllmCheckOptions(fault="slow-last", slow_s=90.0, calls=2)
    assert check._healthy(opts, tmp_path, {}, tmp_path / "spec.json") == status
    lines = capsys.readouterr().out.splitlines()
    if status == 0:
        assert lines[-1].startswith("PASS")
    else:
        assert "FAIL" in lines and not any(line.startswith("PASS") for line in lines)
