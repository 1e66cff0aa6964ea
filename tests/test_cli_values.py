"""Bad values on the command line: one line naming the flag, exit 2, before
any work starts (no traceback; ``bench --json`` to a missing directory does
not run the bench first). Non-finite numbers are refused at parsing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ppsync.cli import main


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    try:
        code = main(argv)
    except SystemExit as e:  # argparse
        code = e.code if isinstance(e.code, int) else 1
    return code, capsys.readouterr().err


def _malformed_schemas(tmp: Path) -> Path:
    assert main(["schema", "export", str(tmp / "s")]) == 0
    for f in (tmp / "s").glob("*.schema.json"):
        f.write_text("{")
    return tmp / "s"


def _not_a_schema(tmp: Path) -> Path:
    assert main(["schema", "export", str(tmp / "s")]) == 0
    for f in (tmp / "s").glob("*.schema.json"):
        f.write_text(json.dumps({"type": 5}))
    return tmp / "s"


PATH_CASES = [
    pytest.param(["dump", "trace", "{d}", "-o", "/nonexistent/t.json"], "-o",
                 id="trace-missing-dir"),
    pytest.param(["dump", "trace", "{d}", "-o", "{tmp}"], "-o", id="trace-to-a-directory"),
    pytest.param(["dump", "trace", "{d}", "-o", "/proc/version"], "-o", id="trace-proc-version"),
    pytest.param(["schema", "export", "/proc/x"], "schema export", id="export-proc"),
    pytest.param(["schema", "export", "/etc/passwd"], "schema export", id="export-a-file"),
    pytest.param(["dump", "validate", "{d}", "--schemas", "/nonexistent"], "--schemas",
                 id="schemas-missing"),
    pytest.param(["dump", "validate", "{d}", "--schemas", "{malformed}"], "--schemas",
                 id="schemas-not-json"),
    pytest.param(["dump", "validate", "{d}", "--schemas", "{not_a_schema}"], "--schemas",
                 id="schemas-not-a-schema"),
    pytest.param(["bench", "--json", "/nonexistent/b.json"], "--json", id="bench-json"),
    pytest.param(["launch", "--pp-size", "2", "--steps", "5", "--report", "/proc/version"],
                 "--report", id="report-proc-version"),
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("argv", "flag"), PATH_CASES)
def test_a_bad_path_is_one_line_and_exit_2(argv: list[str], flag: str, tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    d = tmp_path / "dumps"
    d.mkdir()
    values = {"d": str(d), "tmp": str(tmp_path)}
    if "{malformed}" in argv:
        values["malformed"] = str(_malformed_schemas(tmp_path))
    if "{not_a_schema}" in argv:
        values["not_a_schema"] = str(_not_a_schema(tmp_path))
    capsys.readouterr()
    code, err = _run([a.format(**values) for a in argv], capsys)
    assert code == 2, err
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"ppsync: {flag} "), err


NUMBER_CASES = [
    ["launch", "--pp-size", "2", "--steps", "5", "--jitter-us", "nan"],
    ["launch", "--pp-size", "2", "--steps", "5", "--jitter-us", "inf"],
    ["launch", "--pp-size", "2", "--steps", "5", "--timeout", "nan"],
    ["run", "--steps", "5", "--jitter-us", "inf"],
    ["run", "--steps", "5", "--jitter-us", "nan"],
    ["run", "--steps", "5", "--join-timeout", "inf"],
    ["run", "--steps", "5", "--join-timeout", "1e300"],
    ["run", "--steps", "5", "--progress-every", "nan"],
    ["bench", "--timeout", "inf"],
]


@pytest.mark.parametrize("argv", NUMBER_CASES, ids=lambda a: "-".join(a[0:1] + a[-2:]))
def test_a_non_finite_or_huge_number_is_refused_at_parsing(
    argv: list[str], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)  # run would say so, after parsing
    code, err = _run(argv, capsys)
    assert code == 2, err
    assert "Traceback" not in err, err
    assert f"argument {argv[-2]}: " in err.strip().splitlines()[-1], err
