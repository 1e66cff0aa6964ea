"""Readers take what writers write, refuse what is not a dump, and agree
with each other.

- A FIFO named like a dump, a link to /dev/zero, a directory, an oversized
  (sparse) file: one line naming the file, never a hang or a read into
  memory.
- An error message holding U+2028 / U+0085 / U+2029 (line breaks to
  str.splitlines, not to JSON): the dump's lines survive any reader's split,
  and a reader splits on "\\n" only.
- ``validate`` checks what ``show`` needs: a header-only file, duplicate or
  empty ``group_ranks``, a rank outside its group, a format version newer
  than the reader's are problems, never "ok".
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from ppsync.cli import main
from ppsync.core.path.token_path import TokenPath
from ppsync.core.wire.groups import token_group
from ppsync.debug.cli import SHOW_EXIT
from ppsync.debug.load import MAX_DUMP_BYTES
from ppsync.errors import PeerLost
from ppsync.harness.launcher import RankEnv, spawn_ranks
from ppsync.schemas.config import SyncConfig
from ppsync.schemas.dump import DUMP_DIR_ENV, DUMP_FORMAT_VERSION

BREAKS = "\u2028 \u0085 \u2029"
"""Characters that str.splitlines (and JavaScript) take as line ends, which
JSON may leave raw inside a string."""


def _failed_with_line_breaks(env: RankEnv) -> None:
    config = SyncConfig.build(pp_size=2, max_num_reqs=8, timeout_s=10.0)
    group = token_group(dist.group.WORLD, timeout_s=10.0)  # type: ignore[arg-type]
    path = TokenPath(config, group, board=None)
    if env.rank == 0:
        path.failed(PeerLost(f"peer said: {BREAKS} end", peer=1))  # dumps it
    path.close(drain=False)


@pytest.fixture(scope="module")
def broken_lines(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("breaks")
    spawn_ranks(_failed_with_line_breaks, 2, timeout_s=30, env={DUMP_DIR_ENV: str(d)})
    return d / "ppsync-rank0.jsonl"


def _show(files: list[Path], capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    capsys.readouterr()
    code = main(["dump", "show", "--json", *map(str, files)])
    report: dict[str, Any] = json.loads(capsys.readouterr().out)
    assert code == SHOW_EXIT[report["verdict"]], (code, report["verdict"])
    return report


def test_a_message_with_unicode_line_breaks_stays_on_its_line(
        broken_lines: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text = broken_lines.read_text()
    assert text.splitlines() == text.split("\n")[:-1]  # no reader splits a line in two
    assert main(["dump", "validate", str(broken_lines)]) == 0, capsys.readouterr().err
    rank = _show([broken_lines], capsys)["groups"][0]["ranks"][0]
    assert rank["error"] == f"PeerLost: peer said: {BREAKS} end", rank
    # a dump written by another writer, with those characters raw in its JSON
    # strings (valid JSON): read the same
    raw = tmp_path / "ppsync-rank0.jsonl"
    raw.write_text(text.replace("\\u2028", "\u2028").replace("\\u2029", "\u2029")
                   .replace("\\u0085", "\u0085"))
    assert "\u2028" in raw.read_text()
    assert main(["dump", "validate", str(raw)]) == 0, capsys.readouterr().err
    assert _show([raw], capsys)["groups"][0]["ranks"][0]["error"] == rank["error"]


def _not_dumps(where: Path, broken_lines: Path) -> dict[str, Path]:
    fifo = where / "ppsync-rank5.jsonl"
    os.mkfifo(fifo)
    zero = where / "ppsync-rank6.jsonl"
    zero.symlink_to("/dev/zero")
    folder = where / "ppsync-rank7.jsonl"
    folder.mkdir()
    huge = where / "ppsync-rank8.jsonl"
    with open(huge, "wb") as f:  # sparse: no disk, no memory
        f.write(broken_lines.read_bytes())
        f.truncate(MAX_DUMP_BYTES + 1)
    return {"fifo": fifo, "/dev/zero": zero, "directory": folder, "oversized": huge}


@pytest.mark.timeout(60)
def test_readers_refuse_what_is_not_a_regular_file_of_a_dumps_size(
        broken_lines: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    files = _not_dumps(tmp_path, broken_lines)
    why = {"fifo": "not a regular file (a FIFO)", "/dev/zero": "(a character device)",
           "directory": "(a directory)", "oversized": "more than a dump's"}
    for name, f in files.items():
        if name == "directory":  # given as FILE, a directory stands for the dumps in it
            continue
        capsys.readouterr()
        assert main(["dump", "validate", str(f)]) == 1, name
        err = capsys.readouterr().err
        assert err.startswith(f"{f}:") and why[name] in err, (name, err)
        assert len(err.strip().splitlines()) == 1, err
    # a directory of dumps: the good one read, each other (a directory named
    # like a dump too) named and skipped
    (tmp_path / "ppsync-rank0.jsonl").write_bytes(broken_lines.read_bytes())
    capsys.readouterr()
    assert main(["dump", "show", str(tmp_path)]) in SHOW_EXIT.values()  # a verdict, read
    err = capsys.readouterr().err
    for name, f in files.items():
        assert f"ppsync: skipping {f}: " in err and why[name] in err, (name, err)
    out = tmp_path / "t.json"
    assert main(["dump", "trace", str(tmp_path), "-o", str(out)]) == 0


def _header_edits() -> dict[str, dict[str, Any]]:
    return {
        "duplicate group_ranks": {"group_ranks": [0, 0], "pp_size": 2},
        "empty group_ranks": {"group_ranks": [], "pp_size": 1},
        "rank outside its group": {"rank": 5},
        "group_rank past the group": {"group_rank": 4},
        "group_ranks not pp_size": {"group_ranks": [0, 1, 2]},
        "negative group rank": {"group_ranks": [0, -1]},
        "format_version 99": {"format_version": 99},
        "group rank outside the world": {"group_ranks": [0, 9]},
    }


def test_validate_refuses_what_show_refuses(
        broken_lines: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    lines = broken_lines.read_text().split("\n")[:-1]
    header = json.loads(lines[0])
    assert header["format_version"] == DUMP_FORMAT_VERSION
    cases = {"header only": [lines[0]]}
    for name, edit in _header_edits().items():
        cases[name] = [json.dumps({**header, **edit}), *lines[1:]]
    for name, content in cases.items():
        f = tmp_path / f"{name.replace(' ', '-')}.jsonl"
        f.write_text("\n".join(content) + "\n")
        capsys.readouterr()
        assert main(["dump", "validate", str(f)]) == 1, name
        err = capsys.readouterr().err
        assert err.startswith(f"{f}:1") or err.startswith(f"{f}:0"), (name, err)
        assert main(["dump", "show", str(f)]) == 1, name  # show refuses it too
        assert f"ppsync: skipping {f}:" in capsys.readouterr().err, name
