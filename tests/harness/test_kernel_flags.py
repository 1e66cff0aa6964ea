"""``ppsync launch`` / ``run`` choose the kernel sets (``--cpu-kernels``,
``--device-kernels``): every variant runs from the command line, the report
names them, and a set that cannot run here is a bad argument (exit 2) before
any rank starts."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from ppsync.cli import main
from ppsync.core.codec.cpu_kernels import numba_error
from ppsync.core.codec.device_kernels import triton_error
from ppsync.schemas.run_report import RunReport

NO_NUMBA = pytest.mark.skipif(numba_error() is not None, reason="numba cannot be loaded here")


@pytest.mark.parametrize(
    ("codec", "flag", "value"),
    [("host", "--cpu-kernels", "numpy"),
     pytest.param("host", "--cpu-kernels", "numba", marks=NO_NUMBA),
     ("device", "--device-kernels", "torch")],
    ids=["host-numpy", "host-numba", "device-torch"],
)
def test_each_kernel_set_runs_from_the_command_line_and_is_named(
    codec: str, flag: str, value: str, tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    path = tmp_path / "report.json"
    argv = ["launch", "--pp-size", "2", "--steps", "30", "--spec", "1", "--max-num-reqs", "8",
            "--codec", codec, flag, value, "--timeout", "20", "--quiet", "--report", str(path)]
    assert main(argv) == 0
    summary = capsys.readouterr().out.strip().splitlines()[-1]
    name = flag.removeprefix("--").replace("-", "_")
    assert re.search(rf"codec={codec} .*{name}={value} .*-> OK", summary), summary
    config = RunReport.model_validate_json(path.read_text()).config
    assert getattr(config, name) == value


@pytest.mark.parametrize("command", ["launch", "run"])
def test_help_shows_the_kernel_flags_and_their_defaults(
    command: str, capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        main([command, "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--device-kernels {auto,triton,torch}" in text
    assert "--cpu-kernels {auto,numba,numpy}" in text
    assert text.count("(default: auto)") >= 2


@pytest.mark.parametrize("command", ["launch", "run", "vllm-check"])
def test_the_old_cpu_kernels_flag_is_refused_naming_the_new(
    command: str, capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exit_:
        main([command, "--host-kernels", "numpy"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err == f"ppsync {command}: error: --host-kernels is now --cpu-kernels\n"
    with pytest.raises(SystemExit):
        main([command, "--help"])
    assert "--host-kernels" not in capsys.readouterr().out


def test_a_kernel_set_that_cannot_run_here_exits_2_before_any_rank(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
) -> None:
    # without Triton: it cannot load; with it, CPU tensors need its interpreter
    # (which tests/conftest.py turns on for every other test)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    why = ("Triton cannot be loaded" if triton_error() is not None
           else "needs Triton's interpreter")
    argv = ["launch", "--pp-size", "2", "--steps", "5", "--codec", "device",
            "--device-kernels", "triton", "--quiet"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert re.fullmatch(rf"ppsync: device_kernels = 'triton'.*{why}.*\n", err), err
