"""``ppsync launch``: exit status, the per-rank table, the JSON report, and
bad arguments."""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest

import ppsync.cli.commands
from ppsync.cli import main
from ppsync.errors import RankFailed
from ppsync.harness.driver import Framework
from ppsync.harness.local_run import format_table, run_local
from ppsync.schemas.config import SyncConfig
from ppsync.schemas.run_report import RankReport, RunReport


def _exit_code(argv: Sequence[str]) -> int:
    """main()'s status whether it returns it or argparse raises SystemExit."""
    try:
        return main(list(argv))
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 1


def test_launch_prints_ok_table_and_writes_a_valid_report(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "report.json"
    argv = ["launch", "--pp-size", "2", "--steps", "60", "--spec", "2", "--max-num-reqs", "8",
            "--seed", "3", "--timeout", "20", "--report", str(path)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    lines = out.strip().splitlines()
    assert lines[0].split()[:4] == ["rank", "group", "role", "steps"]
    assert re.match(r"\s*0\s+0 receiver\s+60 ", lines[1]), lines[1]
    assert re.match(r"\s*1\s+0 last\s+60 ", lines[2]), lines[2]
    assert re.search(r"world=2 pp_size=2 K=2 D=2 max_num_reqs=8 wire=fixed codec=host "
                     r"cpu_kernels=(numba|numpy) mode=sync -> OK",  # as resolved, not "auto"
                     lines[3])

    report = RunReport.model_validate_json(path.read_text())
    assert report.ok
    assert (report.steps, report.seed, report.mode) == (60, 3, "sync")
    assert report.config == SyncConfig.build(
        pp_size=2, max_num_reqs=8, num_speculative_steps=2, timeout_s=20.0
    )
    receiver, last = report.ranks
    assert (receiver.role, last.role) == ("receiver", "last")
    assert (receiver.global_rank, last.global_rank) == (0, 1)
    assert receiver.rows_delivered == receiver.rows_expected > 0
    assert receiver.transfers == last.transfers > 0
    assert last.rows_sent == receiver.rows_delivered + receiver.excluded


@pytest.mark.parametrize("framework", [None, "trio"])
def test_sent_is_delivered_plus_excluded_on_every_receiver(framework: Framework | None) -> None:
    """Every row the last rank sends is either delivered or excluded because
    its request slot was freed while the step was in flight (P = 3, D = 3)."""
    config = SyncConfig.build(pp_size=3, max_num_reqs=8, num_speculative_steps=2,
                              timeout_s=20.0)
    report = run_local(config, steps=300, seed=1, framework=framework)
    *receivers, last = report.ranks
    assert report.ok, report
    for r in receivers:
        assert r.excluded > 0, r  # the workload frees slots of steps in flight
        assert last.rows_sent == r.rows_delivered + r.excluded, (last, r)
    head, row0, *_ = format_table(report).splitlines()
    cols = head.split()
    assert cols[cols.index("sent"):cols.index("delivered") + 1] == [
        "sent", "expected", "excluded", "delivered"]
    values = dict(zip(cols, row0.split(), strict=False))
    assert (values["sent"], values["excluded"]) == ("-", str(receivers[0].excluded))


@pytest.mark.parametrize("framework", ["asyncio", "trio"])
def test_launch_async_reports_async_mode(
    framework: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "report.json"
    argv = ["launch", "--pp-size", "2", "--steps", "40", "--max-num-reqs", "8", "--wire",
            "exact", "--async", framework, "--timeout", "20", "--report", str(path)]
    assert main(argv) == 0
    assert re.search(rf"wire=exact codec=host cpu_kernels=(numba|numpy) mode={framework} -> OK",
                     capsys.readouterr().out)
    report = RunReport.model_validate_json(path.read_text())
    assert report.mode == "async" and report.framework == framework and report.ok
    assert report.ranks[0].rows_delivered == report.ranks[0].rows_expected > 0


@pytest.mark.parametrize(
    ("argv", "stderr"),
    [
        (["--pp-size", "2", "--ring-depth", "3"], r"^ppsync: --ring-depth = 3 exceeds "
                                                   r"--pp-size = 2"),
        (["--pp-size", "0"], r"argument --pp-size: 0 must be in \[2, 1024\]"),
        (["--pp-size", "2", "--spec", "-1"], r"argument --spec: -1 must be in \[0, 64\]"),
        (["--pp-size", "2", "--max-num-reqs", "0"],
         r"argument --max-num-reqs: 0 must be in \[1, 1048576\]"),
        (["--pp-size", "2", "--wire", "tight"], r"--wire: invalid choice: 'tight'"),
        (["--pp-size", "2", "--timeout", "0"], r"--timeout: 0\.0 must be in \(0, 86400\]"),
    ],
    ids=["ring-depth-over-pp-size", "pp-size-zero", "spec-negative", "max-num-reqs-zero",
         "wire-unknown", "timeout-zero"],
)
def test_bad_arguments_exit_2(
    argv: list[str], stderr: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _exit_code(["launch", "--steps", "5", *argv]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err  # one line, naming the flag
    assert re.search(stderr, err), err


def test_negative_seed_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    code = _exit_code(["launch", "--pp-size", "2", "--steps", "5", "--seed", "-1"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert re.search(r"seed", err), err


def test_missing_command_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert _exit_code([]) == 2
    assert "usage: ppsync" in capsys.readouterr().err


def _report(**faults: int) -> RunReport:
    config = SyncConfig.build(pp_size=2, max_num_reqs=8)
    return RunReport(config=config, steps=10, seed=0, ranks=[
        RankReport.model_validate({"rank": 0, "role": "receiver", "steps": 10, "transfers": 4,
                                   "rows_expected": 8, "rows_delivered": 8, **faults}),
        RankReport(rank=1, role="last", steps=10, transfers=4, rows_sent=8),
    ])


def test_faults_exit_1_with_faults_verdict(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(ppsync.cli.commands, "run_local", lambda *a, **k: _report(stale=1))
    assert main(["launch", "--pp-size", "2", "--steps", "10"]) == 1
    out = capsys.readouterr().out
    assert out.rstrip().endswith("-> FAULTS")
    assert "OK" not in out


def test_a_failed_rank_exits_1_naming_the_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def fail(*args: object, **kwargs: object) -> RunReport:
        raise RankFailed("1 of 2 ranks failed; rank 0: boom", {0: "boom"})

    monkeypatch.setattr(ppsync.cli.commands, "run_local", fail)
    assert main(["launch", "--pp-size", "2", "--steps", "10"]) == 1
    assert re.search(r"^ppsync: RankFailed: 1 of 2 ranks failed", capsys.readouterr().err)


def test_console_script_runs() -> None:
    script = Path(sys.executable).with_name("ppsync")
    cmd = [str(script)] if script.exists() else [sys.executable, "-m", "ppsync.cli"]
    proc = subprocess.run(
        [*cmd, "launch", "--pp-size", "2", "--steps", "20", "--max-num-reqs", "4",
         "--timeout", "20"],
        capture_output=True, text=True, timeout=90, check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert re.search(r"mode=sync -> OK: 0 lost / 0 stale / 0 duplicated / 0 corrupt",
                     proc.stdout), proc.stdout


def test_launch_tensor_x_pipeline_world(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["launch", "--pp-size", "2", "--world-size", "4", "--steps", "40",
            "--max-num-reqs", "8", "--timeout", "20", "--quiet"]
    assert main(argv) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    rows = [line.split()[:3] for line in lines[1:5]]
    # vLLM's convention: PP group i holds ranks i, i + tp (tp = 2)
    assert rows == [["0", "0", "receiver"], ["1", "1", "receiver"],
                    ["2", "0", "last"], ["3", "1", "last"]]
    assert re.search(r"world=4 pp_size=2 .* -> OK", lines[5]), lines[5]


def test_launch_world_not_a_multiple_of_pp_size_exits_2(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert _exit_code(["launch", "--pp-size", "2", "--world-size", "3", "--steps", "5"]) == 2
    assert re.search(r"pp_size = 2 must divide world_size = 3", capsys.readouterr().err)


def test_launch_on_the_cpu_twin_of_nccl_reports_the_engine_stream_waits(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["launch", "--pp-size", "2", "--steps", "60", "--spec", "2", "--max-num-reqs", "8",
            "--timeout", "20", "--codec", "device", "--carrier", "device", "--emulate", "nccl",
            "--quiet"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "stream-ordered (twin of nccl): engine-stream waits on transfers not yet consumed" \
        in out, out
    waits = re.findall(r"rank (\d): (\d+) unconsumed, (\d+) at consume", out)
    assert [(r, u) for r, u, _ in waits] == [("0", "0"), ("1", "0")], out
    assert int(waits[0][2]) > 0 and waits[1][2] == "0", out  # the receiver waits at consume
    assert out.strip().endswith("-> OK: 0 lost / 0 stale / 0 duplicated / 0 corrupt"), out
    # the verdict line names what the run used: the sets as resolved, the emulation
    assert re.search(r"codec=device carrier=device device_kernels=torch "
                     r"cpu_kernels=(numba|numpy) emulate=nccl mode=sync -> OK", out), out


def test_launch_with_the_host_carrier_on_the_twin_reports_its_copies(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # the default carrier: frames through pinned memory over gloo, no copy waited on
    argv = ["launch", "--pp-size", "3", "--steps", "200", "--spec", "2", "--max-num-reqs", "8",
            "--timeout", "20", "--codec", "device", "--emulate", "nccl", "--quiet"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "host-completed (the host carrier; twin of a nccl device)" in out, out
    copies = re.findall(r"rank (\d): (\d+) reused early, (\d+) copy waits", out)
    assert copies == [("0", "0", "0"), ("1", "0", "0"), ("2", "0", "0")], out
    assert re.search(r"codec=device carrier=host .* emulate=nccl mode=sync -> OK: 0 lost", out)


def test_unconsumed_waits_on_the_twin_fail_the_run(capsys: pytest.CaptureFixture[str],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    report = _report().model_copy(update={"ranks": [
        r.model_copy(update={"engine_waits_unconsumed": 2 if r.rank == 0 else 0,
                             "engine_waits_consumed": 0, "completion": "stream-ordered"})
        for r in _report().ranks]})
    assert not report.ok
    assert "rank 0: 2 unconsumed, 0 at consume" in format_table(report)


@pytest.mark.parametrize(("flags", "match"), [
    (["--emulate", "nccl", "--carrier", "device"], r"codec = 'host' frames are host buffers"),
    (["--emulate", "nccl", "--codec", "device", "--carrier", "device", "--wire", "exact"],
     r"wire = 'exact'"),
    (["--emulate", "gloo"], r"argument --emulate: invalid choice"),
])
def test_emulate_without_device_frames_on_a_fixed_wire_exits_2(
    flags: list[str], match: str, capsys: pytest.CaptureFixture[str],
) -> None:
    assert _exit_code(["launch", "--pp-size", "2", "--steps", "10", *flags]) == 2
    assert re.search(match, capsys.readouterr().err)
