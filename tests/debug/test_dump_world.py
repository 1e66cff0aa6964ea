"""Dumps describe a world: ``ppsync dump show`` reads every PP group of a
tensor x pipeline run and gives one verdict per group and one for the world.

- TP 2 x PP 2 (groups [0, 2] and [1, 3]) launched as an operator would
  (``python -m ppsync launch`` in a process of its own), world rank 3
  SIGKILLed mid-run: ``show`` names rank 3 and nothing reads OK; the
  launch's error leads with rank 3, and its pointers name only the dumps
  this run wrote (not a directory standing where rank 2's dump belongs,
  not an earlier run's file).
- A clean TP 2 x PP 2 run: both groups shown, the world OK.
- ``--dump-dir`` / ``$PPSYNC_DUMP_DIR`` that cannot hold dumps: exit 2 with
  one line, before the run.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ppsync.cli import main
from ppsync.schemas.dump import DUMP_DIR_ENV

STEPS = 6000  # a few seconds: the kill lands mid-run
VICTIM = 3


def _children(pid: int) -> list[int]:
    """Child processes of ``pid`` in the order they started (the launcher
    starts its store process, then ranks 0, 1, ...)."""
    kids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:  # ppid; fields[19]: start time
            kids.append((int(fields[19]), int(entry.name)))
    return [p for _, p in sorted(kids)]


def _progress(err_file: Path) -> int:
    """The last step rank 0's progress line gave (0: none yet)."""
    steps = re.findall(r"^ppsync: step (\d+)/", err_file.read_text(errors="replace"), re.M)
    return int(steps[-1]) if steps else 0


def _launch_and_kill(dumps: Path, tmp: Path) -> tuple[int, str]:
    err_file = tmp / "launch.err"
    cmd = [sys.executable, "-m", "ppsync", "launch", "--pp-size", "2", "--world-size", "4",
           "--steps", str(STEPS), "--max-num-reqs", "8", "--timeout", "5",
           "--progress-every", "0.2", "--dump-dir", str(dumps)]
    with open(err_file, "wb") as err:
        launch = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err)
    try:
        # past the start: every group's token path is open (a rank killed
        # in its group's handshake leaves no dump there: the world then
        # reads INCOMPLETE, not this test's case)
        deadline = time.monotonic() + 60
        while _progress(err_file) < STEPS // 5:
            assert launch.poll() is None and time.monotonic() < deadline, \
                err_file.read_text(errors="replace")
            time.sleep(0.05)
        kids = _children(launch.pid)
        assert len(kids) == 5, kids  # the store process, ranks 0..3
        os.kill(kids[1 + VICTIM], signal.SIGKILL)
        code = launch.wait(timeout=120)
    finally:
        if launch.poll() is None:
            launch.kill()
            launch.wait(timeout=10)
    return code, err_file.read_text(errors="replace")


@pytest.mark.timeout(200)
def test_a_tp_x_pp_run_with_a_killed_rank_never_reads_ok(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    dumps = tmp_path / "dumps"
    dumps.mkdir()
    (dumps / "ppsync-rank2.jsonl").mkdir()  # where rank 2's dump belongs: it cannot dump
    stale = dumps / "ppsync-rank9.jsonl"
    stale.write_text("an earlier run's file\n")
    code, err = _launch_and_kill(dumps, tmp_path)
    assert code == 1, err
    lines = err.strip().splitlines()
    failed = next(t for t in lines if t.startswith("ppsync: RankFailed:"))
    assert f"ranks failed; rank {VICTIM}: 'rank {VICTIM} died" in failed, failed
    written = sorted(str(p) for p in dumps.glob("ppsync-rank*.jsonl") if p.is_file()
                     and p != stale)
    assert [str(dumps / f"ppsync-rank{r}.jsonl") for r in (0, 1)] == written, written
    assert lines[-2] == f"ppsync: flight records: {' '.join(written)}", lines[-2:]

    capsys.readouterr()
    assert main(["dump", "show", str(dumps)]) == 1  # FAILED: a script can act on it
    text = capsys.readouterr().out
    assert "OK" not in text, text
    assert f"world verdict: FAILED: rank {VICTIM} lost at seq " in text, text
    assert "group [0, 2]" in text and "group [1, 3]" in text, text

    assert main(["dump", "show", "--json", str(dumps)]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["verdict"] == "failed" and report["culprit_rank"] == VICTIM, report
    assert report["world_size"] == 4 and report["world_id"] != 0, report
    groups = {tuple(g["group_ranks"]): g for g in report["groups"]}
    assert sorted(groups) == [(0, 2), (1, 3)], report
    assert groups[1, 3]["verdict"] == "lost" and groups[1, 3]["culprit_rank"] == VICTIM
    assert groups[0, 2]["missing"] == [2], groups[0, 2]  # its dump had no place to go
    assert not any("OK" in g["summary"] for g in report["groups"]), report

    trace = tmp_path / "trace.json"
    assert main(["dump", "trace", str(dumps), "-o", str(trace)]) == 0
    pids = {e["pid"] for e in json.loads(trace.read_text())["traceEvents"]}
    assert pids == {0, 1}, pids  # every group's dumps, not the newest group's


@pytest.mark.timeout(120)
def test_a_clean_tp_x_pp_run_shows_every_group(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["launch", "--pp-size", "2", "--world-size", "4", "--steps", "30",
                 "--max-num-reqs", "8", "--timeout", "10", "--quiet",
                 "--dump-dir", str(tmp_path)]) == 0
    capsys.readouterr()
    assert main(["dump", "show", "--json", str(tmp_path)]) == 0
    captured = capsys.readouterr()
    report = json.loads(captured.out)
    assert "ignored" not in captured.err, captured.err
    assert [g["group_ranks"] for g in report["groups"]] == [[0, 2], [1, 3]], report
    assert [g["verdict"] for g in report["groups"]] == ["ok", "ok"], report
    assert report["verdict"] == "ok" and report["summary"].startswith("OK: 4 ranks in 2 groups")
    # one rank's dump alone: the world is not known to be clean
    assert main(["dump", "show", "--json", str(tmp_path / "ppsync-rank0.jsonl")]) == 3
    report = json.loads(capsys.readouterr().out)
    assert report["verdict"] == "incomplete", report
    assert report["not_at_hand"] == [1, 3] and report["groups"][0]["missing"] == [2], report
    assert "OK" not in report["summary"], report


@pytest.mark.parametrize("where", ["proc", "file", "under-file"])
@pytest.mark.parametrize("how", ["flag", "env"])
def test_a_dump_dir_that_cannot_hold_dumps_is_a_bad_argument(
        where: str, how: str, tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    bad = {"proc": Path("/proc/ppsync-dumps"), "file": a_file,
           "under-file": a_file / "dumps"}[where]
    args = ["--pp-size", "2", "--steps", "5", "--quiet"]
    if how == "flag":
        args += ["--dump-dir", str(bad)]
    else:
        monkeypatch.setenv(DUMP_DIR_ENV, str(bad))
    for command in ("launch", "run"):  # run: before it reads its world's environment
        capsys.readouterr()
        assert main([command, *args]) == 2, (command, where, how)
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1, err
        source = "--dump-dir" if how == "flag" else f"${DUMP_DIR_ENV}"
        assert err.startswith(f"ppsync: {source} {bad}: "), err
