"""Dumps know their run, verdicts come from evidence, readers never trace
back, and dump files are written safely.

- A stalled-then-resumed rank (3 ``ppsync run`` ranks, rank 1 SIGSTOPped
  past the timeout, then SIGCONTed) is the one ``show`` names, though it
  dumps last.
- A directory holding an earlier run's dumps: ``show`` reads the newest run
  and names the run it ignored (a killed rank is lost, not "diverged").
- One rank's dump of a healthy run: the missing ranks are not at hand, not
  lost.
- A token path built anew in one process: its dump, not the older path's,
  is read.
- Binary files, JSON that is not an object, events missing fields, deep
  nesting, truncated files: one line naming file and line, never a traceback.
- A link planted where a dump's temporary file would go is never followed.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from rank_procs import RankProcs, free_port, rank_env
from test_dump_faults import _run, _show

from ppsync.cli import main
from ppsync.core import SampledStep
from ppsync.core.path.token_path import TokenPath
from ppsync.core.rules import BatchView
from ppsync.core.wire.groups import token_group
from ppsync.harness.launcher import RankEnv, spawn_ranks
from ppsync.schemas.config import SyncConfig
from ppsync.schemas.dump import DUMP_DIR_ENV

# -- verdicts -------------------------------------------------------------------------------


@pytest.mark.timeout(90)
def test_a_stalled_then_resumed_rank_is_named(tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    dumps, port = tmp_path / "dumps", free_port()
    procs = RankProcs(tmp_path)
    args = ["--pp-size", "3", "--steps", "1000000", "--max-num-reqs", "8", "--timeout", "3",
            "--progress-every", "0.2", "--dump-dir", str(dumps), "--join-timeout", "30"]
    try:
        for rank in range(3):
            procs.start(rank, rank_env(rank, 3, port), args)
        procs.wait_for_progress(0, 30)
        procs.procs[1].send_signal(signal.SIGSTOP)
        time.sleep(3 + 2.5)  # past the timeout: the others give up on rank 1
        procs.procs[1].send_signal(signal.SIGCONT)
        ended = procs.wait(40)
    finally:
        procs.close()
    assert all(e.code == 1 for e in ended.values()), {r: e.err[-500:] for r, e in ended.items()}
    files = sorted(dumps.glob("ppsync-rank*.jsonl"))
    assert len(files) == 3, files  # the stalled rank dumped too, once it resumed
    report = _show(files, capsys)
    assert report["culprit_rank"] == 1, report
    assert report["verdict"] == "silent", report
    assert report["evidence"] == "every survivor waited on rank 1", report
    # races seen under load: the survivor that gave up second found the first
    # one gone (its connections close as it exits) and raised PeerLost; or both
    # read rank 1's PeerLost on the board once it resumed. Rank 1 outlived
    # their giving up: silent, not lost
    for survivor in sorted(files[0::2], key=_error_wall_ns, reverse=True):
        _error_says(survivor, "PeerLost")
        assert _show(files, capsys)["verdict"] == "silent", survivor


def _error_wall_ns(file: Path) -> int:
    lines = [json.loads(t) for t in file.read_text().splitlines()]
    return min(int(e["wall_ns"]) for e in lines if e.get("kind") == "error")


def _error_says(file: Path, error_type: str) -> None:
    """Rewrite a real dump as if its rank had raised ``error_type``."""
    lines = [json.loads(t) for t in file.read_text().splitlines()]
    for e in lines:
        if e.get("kind") == "error":
            e["error"] = error_type
    lines[-1]["error_type"] = error_type
    file.write_text("".join(json.dumps(e) + "\n" for e in lines))


def test_an_earlier_runs_dumps_are_ignored_and_named(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _run("clean", tmp_path)  # every rank dumps at exit
    dumps = _run("kill", tmp_path)  # rank 1 killed: its dump is the clean run's
    capsys.readouterr()
    assert main(["dump", "show", "--json", str(dumps)]) == 1  # FAILED
    out, err = capsys.readouterr()
    report: dict[str, Any] = json.loads(out)["groups"][0]
    assert report["verdict"] == "lost" and report["culprit_rank"] == 1, report
    assert report["divergence"] is None, report
    assert "; ignored run " in err and "(1 dump)" in err, err


def test_a_missing_dump_of_a_healthy_run_is_not_at_hand(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    dumps = _run("clean", tmp_path)
    report = _show([dumps / "ppsync-rank0.jsonl"], capsys)
    assert report["verdict"] == "ok" and report["culprit_rank"] is None, report
    assert report["missing"] == [1, 2]
    assert "not at hand" in report["evidence"], report


def _rebuilt_rank(env: RankEnv) -> None:
    config = SyncConfig.build(pp_size=2, max_num_reqs=8, timeout_s=10.0)
    view = BatchView(num_reqs=1, idx_mapping_np=torch.tensor([3]).numpy(),
                     num_computed_tokens_np=torch.tensor([9]).numpy(),
                     num_scheduled_tokens_np=torch.tensor([1]).numpy(),
                     prefill_len_np=torch.tensor([4]).numpy())
    for steps in (5, 12):  # a path closed, then one built anew
        group = token_group(dist.group.WORLD, timeout_s=10.0)  # type: ignore[arg-type]
        path = TokenPath(config, group)
        for t in range(steps):
            if path.is_last:
                path.publish(view, SampledStep(
                    torch.tensor([[t]]), torch.ones(1, dtype=torch.int32),
                    torch.zeros(1, dtype=torch.int32)))
            else:
                path.consume()
                path.post(view)
        path.close()
        path.dump()  # into the dump directory, under this path's own name


def test_a_rebuilt_token_paths_dump_supersedes_the_older_one(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spawn_ranks(_rebuilt_rank, 2, timeout_s=30, env={DUMP_DIR_ENV: str(tmp_path)})
    assert len(list(tmp_path.glob("ppsync-rank0*.jsonl"))) == 2
    report = _show([tmp_path], capsys)
    assert [r["last_step"] for r in report["ranks"]] == [12, 12], report


# -- readers --------------------------------------------------------------------------------

BAD_LINES = {
    "list": "[1, 2]",
    "string": '"event"',
    "empty-object": "{}",
    "event-missing-fields": '{"type":"event","kind":"issue"}',
    "deep": "[" * 200_000 + "]" * 200_000,
    "deep-in-object": '{"type":"event","kind":' + "[" * 200_000 + "]" * 200_000 + "}",
}


@pytest.fixture(scope="module")
def good(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("good")
    assert main(["launch", "--pp-size", "2", "--steps", "20", "--max-num-reqs", "8",
                 "--timeout", "5", "--quiet", "--dump-dir", str(d)]) == 0
    return d / "ppsync-rank0.jsonl"


def _bad_files(good: Path, where: Path) -> dict[str, Path]:
    lines = good.read_text().splitlines()
    files = {}
    for name, line in BAD_LINES.items():
        f = where / f"{name}.jsonl"
        f.write_text("\n".join([lines[0], line, *lines[1:]]) + "\n")
        files[name] = f
    (where / "binary.jsonl").write_bytes(b"\x89PNG\r\n\x1a\n\x00\xff\xfe" * 10)
    files["binary"] = where / "binary.jsonl"
    (where / "truncated.jsonl").write_text(lines[0][: len(lines[0]) // 2])
    files["truncated"] = where / "truncated.jsonl"
    return files


def test_readers_never_trace_back(good: Path, tmp_path: Path,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    for name, f in _bad_files(good, tmp_path).items():
        capsys.readouterr()
        assert main(["dump", "validate", str(f)]) == 1, name
        err = capsys.readouterr().err
        assert "Traceback" not in err and err.strip(), (name, err)
        assert all(line.startswith(f"{f}:") for line in err.strip().splitlines()), (name, err)
        for command in (["show", "--json"], ["trace", "-o", str(tmp_path / "t.json")]):
            capsys.readouterr()
            # the good dump alone is one rank of three: show reads INCOMPLETE (3)
            expected = 3 if command[0] == "show" else 0
            assert main(["dump", *command, str(good), str(f)]) == expected, (name, command)
            err = capsys.readouterr().err
            assert f"ppsync: skipping {f}:" in err, (name, err)
            assert "Traceback" not in err
            assert main(["dump", *command, str(f)]) == 1, (name, command)


def test_launch_report_to_a_missing_directory_is_a_bad_argument(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["launch", "--pp-size", "2", "--steps", "5", "--quiet",
                 "--report", str(tmp_path / "nowhere" / "r.json")])
    assert code == 2
    err = capsys.readouterr().err
    assert "--report" in err and "does not exist" in err and "Traceback" not in err, err


# -- writing --------------------------------------------------------------------------------

def _planted_rank(target: Path, env: RankEnv) -> str:
    config = SyncConfig.build(pp_size=2, max_num_reqs=8, timeout_s=10.0)
    group = token_group(dist.group.WORLD, timeout_s=10.0)  # type: ignore[arg-type]
    path = TokenPath(config, group)
    directory = Path(os.environ[DUMP_DIR_ENV])
    name = f"ppsync-rank{env.rank}.jsonl"
    # the names an attacker could guess: the old temporary name, and the dump's own
    (directory / f".{name}.{os.getpid()}.tmp").symlink_to(target)
    (directory / name).symlink_to(target)
    written = path.dump()
    path.close()
    return str(written)


def test_a_planted_link_is_never_followed(tmp_path: Path) -> None:
    target = tmp_path / "precious"
    target.write_text("keep me\n")
    dumps = tmp_path / "dumps"
    dumps.mkdir()
    written = spawn_ranks(functools.partial(_planted_rank, target), 2, timeout_s=30,
                          env={DUMP_DIR_ENV: str(dumps)})
    assert target.read_text() == "keep me\n"
    for w in map(Path, written):
        assert not w.is_symlink() and w.read_text().startswith('{"type":"header"')
    assert not [p for p in dumps.iterdir() if p.name.endswith(".tmp") and not p.is_symlink()]
