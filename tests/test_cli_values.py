"""Bad values on the command line: one line naming the flag, exit 2, before
any work starts (no traceback; ``bench --json`` to a missing directory does
not run the bench first). Non-finite numbers are refused at parsing."""

from __future__ import annotations

import json
import subprocess
import sys
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


FLAG_CASES = [
    (["launch", "--pp-size", "2", "--spec", "100"], "--spec", "100 must be in [0, 64]"),
    (["launch", "--pp-size", "two"], "--pp-size", "invalid int value: 'two'"),
    (["launch", "--pp-size", "1"], "--pp-size", "1 must be in [2, 1024]"),
    (["run", "--pp-size", "1"], "--pp-size", "1 must be in [2, 1024] (P = 1 has no receiver"),
    (["bench", "--pp-size", "1"], "--pp-size", "1 must be in [2, 64]"),
    (["bench", "--rows", "0"], "--rows", "0 must be in [1, 65536]"),
    (["launch", "--pp-size", "2", "--device-kernels", "triton"], "--device-kernels",
     "triton is a kernel set of the device codec; --codec host does not use it"),
    (["run", "--device-kernels", "torch"], "--device-kernels", "--codec host does not use it"),
    (["launch", "--pp-size", "2", "--flight-events", "999999999"], "--flight-events",
     "999999999 must be in [0, 262144]"),
]


@pytest.mark.parametrize(("argv", "flag", "says"), FLAG_CASES,
                         ids=lambda v: "-".join(v) if isinstance(v, list) else None)
def test_a_bad_value_is_one_line_naming_the_flag(
        argv: list[str], flag: str, says: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, err = _run(argv, capsys)
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert f"error: argument {flag}: " in lines[0] and says in lines[0], err


def test_run_refuses_a_world_of_one_as_its_default_pp_size(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """``run`` without --pp-size takes WORLD_SIZE; torchrun with one process
    would check nothing (as ``launch --pp-size 1`` would): refused, exit 2,
    before the rank joins anything."""
    for name, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"),
                        ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "1")):
        monkeypatch.setenv(name, value)
    code, err = _run(["run", "--steps", "10"], capsys)
    assert code == 2, err
    assert err.strip().splitlines() == [
        "ppsync: --pp-size defaults to WORLD_SIZE = 1, which must be >= 2 (P = 1 has no "
        "receiver: nothing to check)"], err


def test_the_bounds_are_the_models_own() -> None:
    """A bound changed in SyncConfig or BenchOptions changes the flag's: the
    parser reads them from the fields, it keeps no copy."""
    from ppsync.cli.flag_values import from_field
    from ppsync.schemas.bench import BenchOptions
    from ppsync.schemas.bounds import field_bounds
    from ppsync.schemas.config import SyncConfig

    assert field_bounds(SyncConfig, "num_speculative_steps") == (0, True, 64, True)
    assert field_bounds(SyncConfig, "timeout_s") == (0, False, 86400, True)
    assert field_bounds(BenchOptions, "pp_size") == (2, True, 64, True)
    parse = from_field(SyncConfig, "num_speculative_steps")
    assert parse("64") == 64
    with pytest.raises(Exception, match="65 must be in"):
        parse("65")


def test_parsing_and_help_import_no_torch() -> None:
    """``ppsync --help`` and a bad argument answer without importing torch."""
    code = ("import sys\n"
            "from ppsync.cli import main\n"
            "for argv in (['--help'], ['launch', '--help'], ['launch', '--pp-size', 'x']):\n"
            "    try:\n"
            "        main(argv)\n"
            "    except SystemExit:\n"
            "        pass\n"
            "print('torch' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, cwd=Path(__file__).parent.parent)
    assert out.stdout.strip().splitlines()[-1] == "False", out.stdout + out.stderr


def test_help_describes_the_tool_and_the_exit_codes() -> None:
    from ppsync.cli.parser import _parser

    text = _parser().format_help()
    assert "carries each step's sampled tokens" in text
    assert "exit status of launch and run: 0" in text and "dump show: 0 OK, 1 FAILED" in text
