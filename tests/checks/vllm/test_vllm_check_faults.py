"""vllm-check's settings, twin counts, faults and timing, without vLLM: the
records the worker hooks write and read back, the fault watch on a stand-in
engine process (a real child and grandchild), the verdicts and reports."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ppsync.checks.vllm import check, faults, worker_hooks
from ppsync.checks.vllm.faults import (
    DEAD_S,
    SLACK_S,
    FaultOutcome,
    fault_failures,
    fault_target,
    format_faults,
    naming_bound_s,
    run_fault,
)
from ppsync.checks.vllm.report import (
    RunResult,
    WorkerRecord,
    failures,
    format_report,
    read_worker_records,
)
from ppsync.checks.vllm.timing import format_timing, per_token_s, timing_failures
from ppsync.cli import main
from ppsync.compat.env import Bounds, bounds_from_env

OURS = "ppsync.compat.vllm.plugin.VllmPPHandler032"
TWIN = {"codec": "device", "cpu_kernels": "numpy", "device_kernels": "torch",
        "completion": "stream-ordered (twin of nccl)"}


def _worker(rank: int, ppsync: bool = True, **kw: object) -> WorkerRecord:
    return WorkerRecord(pid=100 + rank, pp_rank=rank, pp_size=2, runner="R",
                        handler=OURS if ppsync else "vllm.PPHandler", ppsync=ppsync,
                        **kw)  # type: ignore[arg-type]


def test_records_carry_the_path_the_twin_counts_errors_and_the_fault(tmp_path: Path) -> None:
    head = {"event": "handler", "pid": 7, "pp_rank": 0, "pp_size": 2, "runner": "R",
            "handler": OURS, "ppsync": True, **TWIN}
    lines = [head, {"event": "twin", "counts": [0, 1, 2]}, {"event": "twin", "counts": [0, 3, 4]},
             {"event": "fault", "t": 5.0, "action": "stop", "pp_rank": 0, "step": 4},
             {"event": "error", "call": "get_prev_sampled_outputs", "t": 9.5,
              "type": "SyncTimeout", "line": "silent peer rank(s) 1 (global), ..."}]
    (tmp_path / "worker-7.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    (w,) = read_worker_records(tmp_path)
    assert w.path == TWIN and w.twin == (0, 3, 4) and w.fault == (5.0, "stop", 4)
    assert w.errors == ((9.5, "get_prev_sampled_outputs", "SyncTimeout",
                         "silent peer rank(s) 1 (global), ..."),)


def _runs(twin: tuple[int, int, int] | None) -> tuple[RunResult, RunResult]:
    tokens = (((5, 6), (7, 8)),)
    base = RunResult("vLLM's PPHandler", False, (_worker(0, False), _worker(1, False)), tokens)
    ours = RunResult("ppsync's plugin", True, (_worker(0, path=TWIN, twin=twin),
                                               _worker(1, path=TWIN)), tokens)
    return base, ours


def test_the_report_shows_what_each_worker_ran_and_the_twin_counts_gate_the_pass() -> None:
    base, ours = _runs((0, 12, 30))
    report = format_report(base, ours, 2)
    assert ("    ran: codec device, device kernels torch, semantics stream-ordered (twin of "
            "nccl); twin: 0 engine-stream waits on unconsumed transfers, 12 on consumed ones, "
            "30 side-stream waits") in report
    assert "twin: no wait counted" in report  # rank 1 recorded no count
    assert report.endswith("are identical to vLLM's own handler's")
    base, ours = _runs((2, 12, 30))
    assert failures(base, ours, 2) == [
        "ppsync's plugin: PP rank 0: 2 engine-stream waits on transfers not yet consumed (the "
        "twin of a stream-ordered backend: must be 0)"]


def test_fault_targets() -> None:
    assert fault_target("kill-last", 3) == ("kill", 2)
    assert fault_target("stop-last", 2) == ("stop", 1)
    assert fault_target("kill-first", 3) == ("kill", 0)


def _outcome(**kw: object) -> FaultOutcome:
    run = RunResult("ppsync's plugin", True, (), ended_at=kw.pop("ended_at", 108.0),  # type: ignore[arg-type]
                    caller={"type": "vllm.v1.engine.exceptions.EngineDeadError",
                            "first_line": "EngineCore encountered an issue.", "text": ""})
    base = {"run": run, "fault": "stop-last", "rank": 1, "fault_t": 100.0, "exited_after_s": 9.0,
            "bound_s": 60.0, "left": (), "survived_kill": (), "named": 1,
            "named_by": "PP rank 0's SyncTimeout (ppsync)", "named_after_s": 7.5}
    return FaultOutcome(**(base | kw))  # type: ignore[arg-type]


def test_a_fault_passes_when_the_rank_is_named_in_time_and_nothing_is_left() -> None:
    assert fault_failures(_outcome(), 10.0) == []
    assert fault_failures(_outcome(ended_at=None, exited_after_s=None), 10.0) == [
        "ppsync's plugin, stop-last: the engine did not end (still hung after 60 s)"]
    assert fault_failures(_outcome(named_after_s=15.5), 10.0) == [
        "ppsync's plugin, stop-last: PP rank 1 named only 15.5 s after the fault (bound 15 s)"]
    assert fault_failures(_outcome(named=0), 10.0) == [
        "ppsync's plugin, stop-last: the faulted PP rank 1 was not named (PP rank 0 was)"]
    assert fault_failures(_outcome(left=("7 T python",)), 10.0) == [
        "ppsync's plugin, stop-last: processes left: 7 T python"]
    assert fault_failures(_outcome(fault_t=None), 10.0) == [
        "ppsync's plugin, stop-last: PP rank 1 never reached the step of its fault"]
    report = format_faults([_outcome()], 2, 10.0)
    assert "the caller of generate saw: vllm.v1.engine.exceptions.EngineDeadError: EngineCore " \
           "encountered an issue." in report
    assert "PP rank named: PP rank 1, by PP rank 0's SyncTimeout (ppsync), 7.5 s after" in report
    assert report.splitlines()[-1].startswith(
        "PASS: with ppsync's handler every fault named the faulted PP rank within its bound "
        "(stop-last: silent_s 10 + 5 = 15 s)")


def test_the_bound_to_name_a_faulted_rank_follows_the_failure_model() -> None:
    """A stopped rank is silent: named within silent_s (the one the run got,
    15 s by default) + SLACK_S; a killed one is dead: about at once. No
    bound counts timeout_s, the bound on a wait for a live peer."""
    assert naming_bound_s("stop-last", 15.0) == 15.0
    assert naming_bound_s("kill-last", 15.0) == naming_bound_s("kill-first", 4.0) == DEAD_S
    # the defaults: 15 + 5 s for a stopped rank
    assert fault_failures(_outcome(named_after_s=19.9), 15.0) == []
    assert fault_failures(_outcome(named_after_s=20.5), 15.0) == [
        "ppsync's plugin, stop-last: PP rank 1 named only 20.5 s after the fault (bound 20 s)"]
    killed = _outcome(fault="kill-first", rank=0, named=0, named_after_s=DEAD_S + SLACK_S - 0.1)
    assert fault_failures(killed, 15.0) == []
    late = _outcome(fault="kill-first", rank=0, named=0, named_after_s=7.5)
    assert fault_failures(late, 15.0) == [
        "ppsync's plugin, kill-first: PP rank 0 named only 7.5 s after the fault (bound 6 s)"]
    report = format_faults([killed, _outcome()], 2, 15.0)
    assert "within its bound (kill-first: dead 1 + 5 = 6 s; stop-last: silent_s 15 + 5 = 20 s)" \
        in report.splitlines()[-1]


STANDIN_ENGINE = '''\
import json, os, subprocess, sys, time
records = os.environ["PPSYNC_VLLM_CHECK_RECORD"]
action, rank, after = os.environ["PPSYNC_VLLM_CHECK_FAULT"].split(":")
worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
with open(os.path.join(records, "worker-%d.jsonl" % worker.pid), "w") as f:
    f.write(json.dumps({"event": "handler", "pid": worker.pid, "pp_rank": 0, "pp_size": 2,
                        "runner": "R", "handler": "x", "ppsync": True}) + "\\n")
    f.write(json.dumps({"event": "fault", "t": time.time(), "action": action,
                        "pp_rank": int(rank), "step": int(after)}) + "\\n")
    f.write(json.dumps({"event": "error", "call": "receive", "t": time.time() + 0.5,
                        "type": "PeerLost", "line": "lost peer rank(s) 1 (global); ..."}) + "\\n")
if MODE == "hang":
    time.sleep(120)
json.dump({"tokens": [], "generate_s": [], "ended_at": time.time() + 1, "error": {
    "type": "EngineDeadError", "first_line": "dead", "text": "dead"}}, open(sys.argv[2], "w"))
'''


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"


@pytest.mark.parametrize("mode", ["hang", "exit"])
def test_the_fault_watch_is_bounded_and_kills_every_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    script = tmp_path / "engine.py"
    script.write_text(f"MODE = {mode!r}\n" + STANDIN_ENGINE)
    monkeypatch.setattr(faults, "engine_command",
                        lambda spec, out: [sys.executable, str(script), str(spec), str(out)])
    monkeypatch.setattr(faults, "GRACE_S", 0.5)
    t0 = time.monotonic()
    o = run_fault("ppsync's plugin", True, tmp_path, "run", dict(os.environ),
                  tmp_path / "spec.json", "kill-last", 2, 3, 60.0, 2.0)
    assert time.monotonic() - t0 < 30
    assert o.fault_t is not None and o.rank == 1 and o.survived_kill == ()
    (w,) = o.run.workers
    assert not _alive(w.pid)
    assert (o.named, o.named_by) == (1, "PP rank 0's PeerLost (ppsync)")
    if mode == "hang":  # the caller never returned: hung at the bound, both processes listed
        assert o.exited_after_s is None and o.run.caller is None and len(o.left) == 2
        assert "still hung after 2 s" in format_faults([o], 2, 10.0)
    else:  # the caller's process ended, its worker did not
        assert o.exited_after_s is not None and o.run.caller is not None
        assert [p.split()[0] for p in o.left] == [str(w.pid)]
        assert fault_failures(o, 10.0) == [
            f"ppsync's plugin, kill-last: processes left: {o.left[0]}"]


FAULTING = '''\
import json, os, sys
sys.path.insert(0, sys.argv[1])
from ppsync.checks.vllm import worker_faults
out = open(sys.argv[2], "w", buffering=1)
fault = worker_faults.fault_for(1, "broadcast", out)
for i in range(5):
    fault("receive")
    fault("broadcast")
    out.write(json.dumps({"event": "broadcast", "s": 0.0}) + "\\n")
'''


def test_the_faulted_worker_signals_itself_at_its_nth_step(tmp_path: Path) -> None:
    script, rec = tmp_path / "w.py", tmp_path / "worker-1.jsonl"
    script.write_text(FAULTING)
    env = dict(os.environ, **{worker_hooks.ENV_FAULT: "kill:1:3"})
    proc = subprocess.run([sys.executable, str(script), str(Path.cwd()), str(rec)], env=env,
                          timeout=60)
    assert proc.returncode == -signal.SIGKILL
    events = [json.loads(line)["event"] for line in rec.read_text().splitlines()]
    assert events == ["broadcast", "broadcast", "fault"]


def _timed_run(label: str, ppsync: bool, seconds: tuple[float, ...],
               tokens: tuple[tuple[tuple[int, ...], ...], ...]) -> RunResult:
    return RunResult(label, ppsync, (_worker(0, ppsync), _worker(1, ppsync)), tokens, seconds)


def test_timing_medians_per_token_after_the_first_call_and_the_ratio() -> None:
    calls = (((1, 2, 3, 4),) * 2,) * 3  # 3 calls of 8 tokens each
    a = _timed_run("vLLM's PPHandler", False, (9.0, 0.8, 1.6), calls)
    b = _timed_run("ppsync's plugin", True, (9.0, 0.8, 0.8), calls)
    assert per_token_s(a) == pytest.approx(0.15)  # median of 0.1 and 0.2, the first call out
    runs = [a, b, a, dataclasses.replace(b, generate_s=(1.0, 1.2, 1.2))]
    report = format_timing(runs, 2)
    assert "ratio ppsync / vLLM per pair: 0.667, 1.000; median 0.833 (min 0.667, max 1.000)" \
        in report
    assert report.splitlines()[-1].startswith("PASS")
    other = dataclasses.replace(b, tokens=(((1, 2, 3, 5),) * 2,) * 3)
    assert timing_failures([a, other], 2)[0].startswith(
        "run 2 (ppsync's plugin): tokens differ from run 1's: call 0 prompt 0")


def test_settings_flags_reach_ppsyncs_run_and_bad_combinations_exit_2(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    seen: list[check.VllmCheckOptions] = []

    def run_check(opts: check.VllmCheckOptions) -> int:
        seen.append(opts)
        return 0

    monkeypatch.setattr("ppsync.checks.vllm.run_check", run_check)
    assert main(["vllm-check", "--codec", "device", "--emulate", "nccl", "--fault",
                 "stop-last"]) == 0
    (opts,) = seen
    assert opts.settings == (("PPSYNC_CODEC", "device"), ("PPSYNC_EMULATE", "nccl"))
    # a fault run keeps ppsync's default bounds: the verdict reads silent_s from them
    assert (opts.fault, opts.calls, opts.handler_timeout_s, opts.handler_silent_s,
            opts.max_tokens) == ("stop-last", 1, None, None, 64)
    env = check._base_env(tmp_path, opts, standin=False, cpu=True)
    assert (env["PPSYNC_CODEC"], env["PPSYNC_EMULATE"]) == ("device", "nccl")
    assert "PPSYNC_TIMEOUT_S" not in env and "PPSYNC_SILENT_S" not in env
    assert bounds_from_env(env) == Bounds()
    assert main(["vllm-check", "--fault", "stop-last", "--handler-silent", "4",
                 "--handler-timeout", "30"]) == 0
    env = check._base_env(tmp_path, seen[-1], standin=False, cpu=True)
    assert (env["PPSYNC_SILENT_S"], env["PPSYNC_TIMEOUT_S"]) == ("4", "30")
    assert bounds_from_env(env) == Bounds(timeout_s=30.0, silent_s=4.0)
    assert main(["vllm-check", "--codec", "host", "--emulate", "nccl"]) == 2
    assert "PPSYNC_EMULATE = 'nccl' needs the device codec" in capsys.readouterr().err
    assert main(["vllm-check", "--fault", "kill-last", "--repeat", "2"]) == 2


@pytest.mark.parametrize(("silent", "status"), [(None, 0), ("10", 1)])
def test_the_fault_check_judges_by_the_silent_s_ppsyncs_run_gets(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path,
    silent: str | None, status: int
) -> None:
    """A stopped rank named 18 s after the fault: within the default
    silent_s 15 + 5 s; not within PPSYNC_SILENT_S = 10 (+ 5)."""
    def fake_run_fault(label: str, ppsync: bool, *args: object) -> FaultOutcome:
        o = _outcome(named_after_s=18.0)
        return dataclasses.replace(o, run=dataclasses.replace(o.run, label=label,
                                                              expect_ppsync=ppsync))

    monkeypatch.setattr(check, "run_fault", fake_run_fault)
    env = {} if silent is None else {"PPSYNC_SILENT_S": silent}
    opts = check.VllmCheckOptions(fault="stop-last")
    assert check._faults(opts, tmp_path, env, tmp_path / "spec.json") == status
    out = capsys.readouterr().out
    assert ("PASS" if status == 0 else
            "PP rank 1 named only 18.0 s after the fault (bound 15 s)") in out


def test_vllms_executor_names_a_dead_worker_when_it_logs_it(tmp_path: Path) -> None:
    """A dead worker that only vLLM's executor named (ppsync's last rank
    makes no further call) is named at the executor's log line (whole
    seconds: read as the latest), not when vLLM's teardown let generate
    raise; a line without a stamp falls back to that."""
    stamp = time.mktime((2026, 12, 6, 14, 46, 27, 0, 0, -1))
    log = tmp_path / "vllm.log"
    log.write_text("(EngineCore pid=7) ERROR 12-06 14:46:27 [multiproc_executor.py:315] Worker "
                   "proc VllmWorker-0 died unexpectedly (exit code: -9), shutting down executor.\n")
    run = RunResult("ppsync's plugin", True, (), log=str(log), ended_at=stamp + 9.5)
    rank, by, after = faults._named(run, 0, stamp + 0.3)
    assert (rank, by) == (0, "vLLM's executor (a worker process died)")
    assert after is not None and abs(after - 0.7) < 1e-6
    log.write_text("Worker proc VllmWorker-0 died unexpectedly\n")
    rank, by, after = faults._named(run, 0, stamp + 0.3)
    assert rank == 0 and after is not None and abs(after - 9.2) < 1e-6
