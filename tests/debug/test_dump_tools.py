"""``ppsync launch --dump-dir``, ``ppsync dump validate`` / ``trace`` and
``ppsync schema export`` on the dumps of a real P = 3 run."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import ppsync.cli.commands
from ppsync.cli import main
from ppsync.errors import RankFailed
from ppsync.schemas.export import DIALECT, MODELS, export
from ppsync.schemas.run_report import RunReport

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def dumps(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Path]]:
    """The dumps of one clean ``ppsync launch --dump-dir`` run (at exit)."""
    d = tmp_path_factory.mktemp("dumps")
    argv = ["launch", "--pp-size", "3", "--steps", "60", "--spec", "1", "--max-num-reqs", "8",
            "--timeout", "5", "--dump-dir", str(d)]
    assert main(argv) == 0
    yield sorted(d.glob("ppsync-rank*.jsonl"))


def test_schemas_dir_is_a_fresh_export(tmp_path: Path) -> None:
    fresh = export(tmp_path)
    committed = sorted(p.name for p in (REPO / "schemas").glob("*.json"))
    assert committed == sorted(p.name for p in fresh), "run: ppsync schema export schemas"
    for p in fresh:
        doc = json.loads(p.read_text())
        assert doc["$schema"] == DIALECT
        assert (REPO / "schemas" / p.name).read_text() == p.read_text(), (
            f"schemas/{p.name} is stale: run `ppsync schema export schemas`")
    assert len(fresh) == len(MODELS)


def test_launch_dumps_every_rank_and_they_validate(
    dumps: list[Path], capsys: pytest.CaptureFixture[str]
) -> None:
    assert [p.name for p in dumps] == [f"ppsync-rank{r}.jsonl" for r in range(3)]
    assert main(["dump", "validate", *map(str, dumps)]) == 0
    assert capsys.readouterr().out.count(": ok") == 3


@pytest.mark.parametrize(
    ("field", "value", "named"),
    [("seq", "x", "seq"), ("bogus", 1, "bogus"), ("kind", "teleport", "kind")],
    ids=["wrong-type", "unknown-field", "bad-enum"],
)
def test_validate_rejects_a_wrong_field_naming_file_line_and_field(
    dumps: list[Path], tmp_path: Path, capsys: pytest.CaptureFixture[str],
    field: str, value: object, named: str,
) -> None:
    lines = dumps[0].read_text().splitlines()
    event = json.loads(lines[2])
    event[field] = value
    lines[2] = json.dumps(event)
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join(lines) + "\n")
    capsys.readouterr()
    assert main(["dump", "validate", str(dumps[1]), str(bad)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err and all(e.startswith(f"{bad}:3: {named}: ") for e in err), err


def test_validate_rejects_a_missing_footer(dumps: list[Path], tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "cut.jsonl"
    bad.write_text("\n".join(dumps[0].read_text().splitlines()[:-1]) + "\n")
    assert main(["dump", "validate", str(bad)]) == 1
    assert "'event' where a 'footer' line belongs" in capsys.readouterr().err


def _check_trace_event(e: dict[str, Any]) -> None:
    for key in ("ph", "ts", "pid", "tid", "name"):
        assert key in e, (key, e)
    assert e["ph"] in ("X", "i", "M"), e
    assert isinstance(e["ts"], (int, float)) and isinstance(e["pid"], int)
    if e["ph"] == "X":
        assert isinstance(e["dur"], (int, float)) and e["dur"] >= 0, e
    if e["ph"] == "i":
        assert e["s"] in ("t", "p", "g"), e


def test_trace_follows_the_trace_event_format_and_holds_every_event(
    dumps: list[Path], tmp_path: Path
) -> None:
    out = tmp_path / "trace.json"
    assert main(["dump", "trace", *map(str, dumps), "-o", str(out)]) == 0
    doc = json.loads(out.read_text())
    events = doc["traceEvents"]
    for e in events:
        _check_trace_event(e)
    for path in dumps:
        lines = [json.loads(t) for t in path.read_text().splitlines()]
        rank = lines[0]["rank"]
        recorded = {e["index"] for e in lines[1:-1]}
        assert recorded, path
        mine = [e for e in events if e["pid"] == rank and e["ph"] != "M"]
        shown = {e["args"]["index"] for e in mine} | {
            e["args"]["end_index"] for e in mine if e["args"].get("end_index") is not None}
        assert recorded <= shown, sorted(recorded - shown)[:10]
        names = {e["args"]["name"] for e in events if e["pid"] == rank and e["ph"] == "M"}
        assert any(n.startswith(f"rank {rank} ") for n in names), names
        # one transfer slice per frame this rank issued
        issued = {e["seq"] for e in lines[1:-1] if e["kind"] == "issue"}
        frames = {int(e["name"].split()[1]) for e in mine if e.get("cat") == "transfer"
                  and e["ph"] == "X"}
        assert frames == issued


def test_a_failed_launch_points_at_the_dumps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def fail(*args: object, **kwargs: object) -> RunReport:
        (tmp_path / "ppsync-rank0.jsonl").write_text("")
        raise RankFailed("1 of 2 ranks failed; rank 1 died", {1: "died"})

    monkeypatch.setattr(ppsync.cli.commands, "run_local", fail)
    assert main(["launch", "--pp-size", "2", "--steps", "5", "--dump-dir", str(tmp_path)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-2] == f"ppsync: flight records: {tmp_path}/ppsync-rank0.jsonl", err
    assert err[-1] == f"ppsync: diagnose with: ppsync dump show {tmp_path}/ppsync-rank*.jsonl"


def test_recorder_off_dumps_header_and_footer_only(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["launch", "--pp-size", "2", "--steps", "20", "--max-num-reqs", "4", "--timeout", "5",
            "--flight-events", "0", "--dump-dir", str(tmp_path)]
    assert main(argv) == 0
    files = sorted(tmp_path.glob("ppsync-rank*.jsonl"))
    assert len(files) == 2
    for f in files:
        lines = [json.loads(t) for t in f.read_text().splitlines()]
        assert [d["type"] for d in lines] == ["header", "footer"]
        assert lines[0]["capacity"] == lines[0]["recorded"] == 0
    assert main(["dump", "validate", str(tmp_path)]) == 0
    capsys.readouterr()
    assert main(["dump", "show", "--json", str(tmp_path)]) == 0
    assert json.loads(capsys.readouterr().out)["verdict"] == "ok"
