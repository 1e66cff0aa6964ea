"""The SGLang guard inside a real SGLang 0.5.23 engine at pp_size 2 (the
cases of ``ppsync sglang-check``), each run bounded. Skipped where SGLang's
venv is absent: ``make sglang-check`` builds it (.venv-sglang), or
``PPSYNC_SGLANG_PYTHON`` names an interpreter that has SGLang."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from ppsync.checks.sglang.check import SglangCheckOptions, run_case

ROOT = Path(__file__).resolve().parents[2]


def _sglang_python() -> str | None:
    named = os.environ.get("PPSYNC_SGLANG_PYTHON")
    candidate = Path(named) if named else ROOT / ".venv-sglang" / "bin" / "python"
    if not candidate.exists():
        return None
    probe = subprocess.run([str(candidate), "-c", "import sglang"], capture_output=True,
                           timeout=120, check=False)
    return str(candidate) if probe.returncode == 0 else None


PYTHON = _sglang_python()
pytestmark = [
    pytest.mark.skipif(PYTHON is None, reason="no SGLang here: `make sglang-check` builds "
                       ".venv-sglang (SGLang 0.5.23, about 9 GB), or set PPSYNC_SGLANG_PYTHON "
                       "to a python that has SGLang"),
    pytest.mark.timeout(1200),
]


SILENT_S = 3.0  # the guard's PPSYNC_SILENT_S here (timeout_s: ppsync's default)


def _options(tmp_path: Path, **kw: object) -> SglangCheckOptions:
    assert PYTHON is not None
    opts = SglangCheckOptions(python=PYTHON, work_dir=tmp_path, silent_s=SILENT_S, hang_s=20.0,
                              run_limit_s=400.0)
    for k, v in kw.items():
        setattr(opts, k, v)
    return opts


def test_tokens_identical_and_the_guard_on_every_stage(tmp_path: Path) -> None:
    verdict, report = run_case("none", _options(tmp_path))
    assert verdict.passed, report


def test_a_perturbed_view_is_named_and_unseen_without_the_check(tmp_path: Path) -> None:
    verdict, report = run_case("desync", _options(tmp_path / "on"))
    assert verdict.passed, report
    assert "first differing field rids" in report
    verdict, report = run_case("desync", _options(tmp_path / "off", view_check=False))
    assert not verdict.passed, report  # the desync case fails with the view check off


@pytest.mark.parametrize("fault", ["kill-last", "stop-last"])
def test_a_lost_or_stopped_last_stage_is_named_within_its_bound(tmp_path: Path,
                                                                fault: str) -> None:
    verdict, report = run_case(fault, _options(tmp_path))
    assert verdict.passed, report
    assert "PP stage 1 (global rank 1)" in report


def test_a_last_stage_slow_past_silent_s_in_one_step_is_no_fault(tmp_path: Path) -> None:
    verdict, report = run_case("slow-last", _options(tmp_path, slow_s=4 * SILENT_S))
    assert verdict.passed, report
    assert "12.0 s on stage 1" in report
