"""Flight-recorder dumps of real P = 3 runs, and ``ppsync dump show`` on
them: a clean run dumped at exit, the middle rank killed (SIGKILL) or
stopped (SIGSTOP), one rank's num_reqs differing at one step, one rank
skipping a step's post.

Every rank runs the same loop over a TokenPath with a failure board; the
dump directory comes from ``PPSYNC_DUMP_DIR``, as ``ppsync launch
--dump-dir`` sets it. Every step has a transfer (all rows decode), so frame
seq t belongs to step t and the test knows which seq a fault hits. Each
rank writes what it caught, and when, to a file (``spawn_ranks`` drops the
survivors' return values when a rank dies). Checks: every surviving rank
dumped within timeout_s + 5 s of the fault, every dump validates against
the schemas, and ``dump show --json`` names rank 1 and the right seq.
"""

from __future__ import annotations

import contextlib
import faulthandler
import functools
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any, Literal

import anyio
import numpy as np
import pytest
import torch
import torch.distributed as dist

from ppsync.cli import main
from ppsync.core import SampledStep
from ppsync.core.path.token_path import TokenPath
from ppsync.core.rules import BatchView
from ppsync.core.wire.board import FailureBoard
from ppsync.core.wire.groups import token_group
from ppsync.debug.cli import SHOW_EXIT
from ppsync.debug.load import validate_file, validators
from ppsync.errors import PPSyncError, RankFailed
from ppsync.harness.launcher import RankEnv, spawn_ranks
from ppsync.schemas.config import SyncConfig
from ppsync.schemas.dump import DUMP_DIR_ENV
from ppsync.services.runtime import open_rank

PP_SIZE = 3
TIMEOUT_S = 3.0
VICTIM = 1  # the middle rank: a receiver with a peer on each side
AT = 30  # the step (= frame seq) of the fault
CLEAN_STEPS = 40
FAULT_STEPS = 100_000  # survivors run until the fault stops them
ROWS = 4
CONFIG = SyncConfig.build(pp_size=PP_SIZE, max_num_reqs=8, timeout_s=TIMEOUT_S)

Case = Literal["clean", "kill", "stop", "desync", "skip"]


def write_json(path: Path, data: object) -> None:
    """Write ``data`` as JSON atomically: a reader never sees half a file."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    tmp.rename(path)


def watchdog(seconds: float) -> None:
    """In a rank process: print every stack and exit if still running after
    ``seconds`` (before spawn_ranks gives up on the run)."""
    faulthandler.dump_traceback_later(seconds, exit=True, file=sys.__stderr__ or sys.stderr)


def _view(t: int, rows: int = ROWS) -> BatchView:
    """Step t: ``rows`` decode rows; computed counts grow with t, so every
    step's idx digest differs."""
    return BatchView(
        num_reqs=rows,
        idx_mapping_np=np.arange(rows, dtype=np.int64),
        num_computed_tokens_np=np.full(rows, 10 + t, dtype=np.int64),
        num_scheduled_tokens_np=np.ones(rows, dtype=np.int64),
        prefill_len_np=np.full(rows, 5, dtype=np.int64),
    )


def _outputs(t: int, rows: int) -> SampledStep:
    return SampledStep(torch.full((rows, 1), t, dtype=torch.int64),
                       torch.ones(rows, dtype=torch.int32), torch.zeros(rows, dtype=torch.int32))


def _loop(case: Case, path: TokenPath, env: RankEnv, out: Path) -> None:
    steps = CLEAN_STEPS if case == "clean" else FAULT_STEPS
    for t in range(steps):
        if case == "clean" and env.rank == 0 and t == AT:
            os.kill(os.getpid(), signal.SIGUSR1)  # handled at once, in this thread
            dump = Path(os.environ[DUMP_DIR_ENV]) / "ppsync-rank0.jsonl"
            dump.rename(out / "signal-rank0.jsonl")  # before the exit dump replaces it
        victim = env.rank == VICTIM and t == AT
        if victim and case in ("kill", "stop"):
            write_json(out / "victim.json", {"pid": os.getpid(), "at": time.monotonic()})
            os.kill(os.getpid(), signal.SIGKILL if case == "kill" else signal.SIGSTOP)
        if not path.is_last:
            path.consume()
        if victim and case == "skip":
            continue  # this rank's step AT has no post: its seqs run one step behind
        rows = ROWS - 1 if victim and case == "desync" else ROWS
        if path.is_last:
            path.publish(_view(t, rows), _outputs(t, rows))
        else:
            path.post(_view(t, rows))
    path.close()


async def _async_kill_loop(group: dist.ProcessGroup, board: FailureBoard, env: RankEnv,
                           out: Path) -> None:
    """The kill case through the anyio services (open_rank)."""
    async with open_rank(CONFIG, group, board=board) as rank:
        for t in range(FAULT_STEPS):
            if env.rank == VICTIM and t == AT:
                write_json(out / "victim.json", {"pid": os.getpid(), "at": time.monotonic()})
                os.kill(os.getpid(), signal.SIGKILL)
            if env.rank == 0 and t == AT // 2:
                rank.dump(out / "asked-rank0.jsonl")  # on request, mid-run
            if not rank.is_last:
                await rank.take()
            if rank.is_last:
                await rank.publish(_view(t), _outputs(t, ROWS))
            else:
                await rank.post(_view(t))


def _rank(case: Case, out: Path, env: RankEnv, framework: str | None = None) -> None:
    watchdog(TIMEOUT_S + 12)
    group = token_group(dist.group.WORLD, timeout_s=TIMEOUT_S)  # type: ignore[arg-type]
    board = env.failure_board(group)
    error: PPSyncError | None = None
    if framework is not None:
        try:
            anyio.run(_async_kill_loop, group, board, env, out, backend=framework)
        except PPSyncError as e:
            error = e
    else:
        path = TokenPath(CONFIG, group, board=board)
        try:
            _loop(case, path, env, out)
        except PPSyncError as e:
            error = e
            path.close(drain=False)
    write_json(out / f"rank{env.rank}.json", {
        "error": "" if error is None else type(error).__name__,
        "message": "\n".join([str(error or ""), *getattr(error, "__notes__", [])]),
        "at": time.monotonic(),
    })
    if case == "stop" and env.rank == 0:
        _kill_stopped_victim(out)


def _kill_stopped_victim(out: Path) -> None:
    """Rank 0, as the operator would: once every survivor reported, kill the
    stopped rank (a stopped process cannot dump, nor exit by itself)."""
    deadline = time.monotonic() + TIMEOUT_S + 5
    while time.monotonic() < deadline and not (out / "rank2.json").exists():
        time.sleep(0.05)
    pid = json.loads((out / "victim.json").read_text())["pid"]
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def _run(case: Case, tmp_path: Path, framework: str | None = None) -> Path:
    """Run the case (through the services on ``framework``: kill only);
    return the dump directory."""
    dumps = tmp_path / "dumps"
    target = functools.partial(_rank, case, tmp_path, framework=framework)
    env = {DUMP_DIR_ENV: str(dumps)}
    if case in ("kill", "stop"):
        with pytest.raises(RankFailed) as info:
            spawn_ranks(target, PP_SIZE, timeout_s=TIMEOUT_S, env=env)
        assert list(info.value.errors) == [VICTIM], info.value.errors
    else:
        spawn_ranks(target, PP_SIZE, timeout_s=TIMEOUT_S, env=env)
    return dumps


def _show(files: list[Path], capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    capsys.readouterr()
    code = main(["dump", "show", "--json", *map(str, files)])
    world: dict[str, Any] = json.loads(capsys.readouterr().out)
    assert code == SHOW_EXIT[world["verdict"]], (code, world["verdict"])
    assert len(world["groups"]) == 1, world  # one PP group: the world's report holds it
    report: dict[str, Any] = world["groups"][0]
    return report


def _check_dumps(dumps: Path, ranks: list[int]) -> list[Path]:
    files = sorted(dumps.glob("ppsync-rank*.jsonl"))
    assert [f.name for f in files] == [f"ppsync-rank{r}.jsonl" for r in ranks]
    checks = validators()
    for f in files:
        assert validate_file(f, checks) == [], f
    return files


def test_clean_run_dumps_at_exit_and_on_sigusr1(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    dumps = _run("clean", tmp_path)
    # SIGUSR1 printed the stacks (faulthandler) and dumped the flight record
    assert "most recent call first" in capfd.readouterr().err
    on_signal = tmp_path / "signal-rank0.jsonl"
    assert validate_file(on_signal, validators()) == []
    lines = [json.loads(t) for t in on_signal.read_text().splitlines()]
    assert lines[0]["reason"] == "signal"
    assert max(e["seq"] for e in lines[1:-1]) == AT - 1  # rank 0's last issue before it
    files = _check_dumps(dumps, [0, 1, 2])
    for f in files:
        lines = [json.loads(t) for t in f.read_text().splitlines()]
        assert lines[0]["reason"] == "exit"
        assert lines[-1]["error_type"] is None and lines[-1]["in_flight"] == []
        assert {e["kind"] for e in lines[1:-1]} >= {"issue"}
    report = _show(files, capfd)
    assert report["verdict"] == "ok" and report["culprit_rank"] is None, report
    assert report["missing"] == [] and report["divergence"] is None
    assert [r["last_seq"] for r in report["ranks"]] == [CLEAN_STEPS - 1] * 3


def _survivors_dumped_in_time(tmp_path: Path, fault_at: float) -> dict[int, dict[str, Any]]:
    seen = {}
    for r in range(PP_SIZE):
        if r == VICTIM:
            continue
        o = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert o["error"], o  # the fault stopped it
        assert "\nflight record: " in o["message"], o  # a note names the dump
        assert 0 <= o["at"] - fault_at <= TIMEOUT_S + 5, o
        seen[r] = o
    return seen


@pytest.mark.parametrize(("case", "framework"),
                         [("kill", None), ("stop", None), ("kill", "asyncio")],
                         ids=["kill", "stop", "kill-asyncio"])
def test_lost_or_silent_middle_rank_is_named(
    case: Case, framework: str | None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dumps = _run(case, tmp_path, framework)
    if framework is not None:
        asked = tmp_path / "asked-rank0.jsonl"
        assert validate_file(asked, validators()) == []
        assert json.loads(asked.read_text().splitlines()[0])["reason"] == "request"
    fault_at = json.loads((tmp_path / "victim.json").read_text())["at"]
    outcomes = _survivors_dumped_in_time(tmp_path, fault_at)
    files = _check_dumps(dumps, [0, 2])
    for f in files:  # one failure, one error recorded and dumped (the services included)
        kinds = [json.loads(t).get("kind") for t in f.read_text().splitlines()]
        assert kinds.count("error") == 1, (f, kinds[-5:])
    report = _show(files, capsys)
    print(json.dumps(report["summary"]))
    assert report["missing"] == [VICTIM], report
    assert report["culprit_rank"] == VICTIM, report
    assert report["verdict"] == ("lost" if case == "kill" else "silent"), (report, outcomes)
    # the victim issued frames up to AT - 1 and never AT: survivors wait from
    # somewhere in the ring's reach of AT
    seq = report["culprit_seq"]
    assert AT - CONFIG.depth <= seq <= AT + CONFIG.depth, report
    assert report["summary"].startswith(f"rank {VICTIM} {report['verdict']} at seq {seq}: "
                                        "ranks 0 and 2 waited on it"), report["summary"]


@pytest.mark.parametrize("case", ["desync", "skip"])
def test_diverging_rank_is_named_at_its_first_seq(
    case: Case, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dumps = _run(case, tmp_path)
    for r in range(PP_SIZE):
        o = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert o["error"] in ("DesyncError", "PeerLost"), o
    files = _check_dumps(dumps, [0, 1, 2])
    report = _show(files, capsys)
    assert report["verdict"] == "desync", report
    assert (report["culprit_rank"], report["culprit_seq"]) == (VICTIM, AT), report
    div = report["divergence"]
    assert div["ranks"] == [VICTIM] and div["others"] == [0, 2], div
    if case == "desync":
        assert (div["view"]["num_reqs"], div["others_view"]["num_reqs"]) == (ROWS - 1, ROWS)
    else:  # its seq AT carries step AT + 1's view
        assert div["view"]["idx_digest"] != div["others_view"]["idx_digest"], div
