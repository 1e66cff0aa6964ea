"""``make gpu-check``'s table, on CPU: each check in a fresh process bounded
at its bound (a hung worker and the ranks it started are ended, and its row
says so), each row printed and flushed as it ends, the run's budget, and the
summary's lines."""

from __future__ import annotations

import functools
import io
import os
import re
import shutil
import signal
import subprocess
import time
import tomllib
from pathlib import Path

import pytest

from ppsync.checks.gpu import check as gpu_check
from ppsync.checks.gpu.check import Check
from ppsync.checks.gpu.stream_checks import CheckSkipped
from ppsync.harness.fresh import KILL_GRACE_S, STACKS_S, Overran, in_fresh_process
from ppsync.harness.launcher import RankEnv, spawn_ranks

ROOT = Path(__file__).resolve().parents[3]
SLACK_S = 20.0
"""What a loaded CI machine may add to a bound (starting the interpreter)."""


def passes(detail: str) -> tuple[bool, str]:
    return True, detail


def fails() -> tuple[bool, str]:
    return False, "what it tests is false"


def raises() -> tuple[bool, str]:
    raise ValueError("a broken check")


class TwoArgs(Exception):
    def __init__(self, message: str, extra: int) -> None:
        super().__init__(message)  # pickles as TwoArgs(message): does not come back
        self.extra = extra


def raises_unpicklable() -> tuple[bool, str]:
    raise TwoArgs("two args", 2)


def skips() -> tuple[bool, str]:
    raise CheckSkipped("cannot run here")


def hangs(pid_file: str, ignore_term: bool) -> tuple[bool, str]:
    if ignore_term:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    Path(pid_file).write_text(str(os.getpid()))
    time.sleep(3600)
    return True, "never"


def _hung_rank(pid_file: str, env: RankEnv) -> None:
    Path(pid_file).write_text(str(os.getpid()))
    time.sleep(3600)


def hangs_in_its_ranks(pid_file: str) -> tuple[bool, str]:
    spawn_ranks(functools.partial(_hung_rank, pid_file), 1, timeout_s=3600)
    return True, "never"


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # a zombie not yet reaped by its (ended) parent's reaper is gone too
    return "State:\tZ" in Path(f"/proc/{pid}/status").read_text()


def _wait_gone(pid: int, bound_s: float = 10.0) -> bool:
    deadline = time.monotonic() + bound_s
    while not _gone(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_in_fresh_process_returns_and_reraises() -> None:
    assert in_fresh_process(passes, "x", timeout_s=60) == (True, "x")
    with pytest.raises(ValueError, match="a broken check") as caught:
        in_fresh_process(raises, timeout_s=60)
    (where,) = caught.value.__notes__
    assert where.startswith("in the fresh process ") and "in raises" in where
    with pytest.raises(RuntimeError, match=r"^TwoArgs: two args\n"):
        in_fresh_process(raises_unpicklable, timeout_s=60)


@pytest.mark.parametrize(("ignore_term", "how"), [(False, "terminated"), (True, "killed")])
def test_a_hung_check_is_ended_within_its_bound_and_its_row_says_so(
        tmp_path: Path, ignore_term: bool, how: str) -> None:
    pid_file = tmp_path / "pid"
    bound = 12.0  # the worker's start (imports) counts in it
    t0 = time.monotonic()
    name, status, detail, _ = gpu_check.run_check(
        Check("z) hangs", functools.partial(hangs, str(pid_file), ignore_term), bound), 300)
    took = time.monotonic() - t0
    assert (name, status) == ("z) hangs", "FAIL")
    assert f"hung: no result within {bound:.0f} s: the worker was {how}" in detail
    # the bound, then the stacks and (ignoring SIGTERM) the kill's grace: nothing waits longer
    assert took < bound + STACKS_S + KILL_GRACE_S + SLACK_S, took
    assert _gone(int(pid_file.read_text()))


def test_a_hung_checks_ranks_end_with_it(tmp_path: Path) -> None:
    pid_file = tmp_path / "rank-pid"
    with pytest.raises(Overran) as caught:
        in_fresh_process(hangs_in_its_ranks, str(pid_file), timeout_s=15)
    assert caught.value.how in ("terminated", "killed")
    assert _wait_gone(int(pid_file.read_text()))


class Flushes(io.StringIO):
    """Output that keeps what had been written at each flush."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def flush(self) -> None:
        super().flush()
        self.seen.append(self.getvalue())


def test_each_row_is_printed_and_flushed_as_its_check_ends() -> None:
    out = Flushes()
    rows = gpu_check.run_table([
        Check("a) passes", functools.partial(passes, "fine"), 60),
        Check("b) fails", fails, 60),
        Check("c) raises", raises, 60),
        Check("d) skips", skips, 60),
        Check("e) not run", fails, 60, skip="needs >= 2 GPUs"),
    ], budget_s=300, out=out)
    assert [r[1] for r in rows] == ["PASS", "FAIL", "FAIL", "SKIP", "SKIP"]
    assert rows[2][2] == "ValueError: a broken check" and rows[3][2] == "cannot run here"
    # one flush for the header, then one per row, each holding the rows so far
    assert len(out.seen) == 6
    for i, snapshot in enumerate(out.seen[1:]):
        lines = snapshot.splitlines()
        assert len(lines) == i + 2 and lines[-1].startswith(rows[i][0])
        assert rows[i][1] in lines[-1]


def test_checks_that_cannot_start_within_the_budget_are_skipped() -> None:
    rows = gpu_check.run_table([Check("a) passes", functools.partial(passes, "x"), 60),
                                Check("b) passes", functools.partial(passes, "y"), 60)],
                               budget_s=5, out=io.StringIO())
    assert [r[1] for r in rows] == ["SKIP", "SKIP"]
    assert rows[0][2].startswith("not started: ") and "left of the run's budget" in rows[0][2]


def test_the_checks_fit_the_run_and_each_bound() -> None:
    table = gpu_check.checks(steps=10, gpus=1)
    assert [c.name[0] for c in table] == list("abcdefghijklmnop")
    assert all(60 <= c.bound_s <= 90 for c in table)
    assert {c.name[0] for c in table if c.skip.startswith("1 GPU")} == {"c", "i"}
    assert gpu_check.RUN_BUDGET_S + STACKS_S + KILL_GRACE_S < 360  # make's outer timeout
    assert "timeout -k 10 360" in (ROOT / "Makefile").read_text()


def test_the_summary_says_counts_wall_time_and_what_one_gpu_cannot_check() -> None:
    rows = [("a) x", "PASS", "", 1.0), ("b) y", "FAIL", "", 2.0), ("c) z", "SKIP", "", 0.0)]
    lines = gpu_check.summary(rows, 123.4, 330, gpus=0)
    assert lines[0] == "gpu-check: 1 passed, 1 failed, 1 skipped; wall time 123.4 s (budget 330 s)"
    assert lines[1].startswith("carrier: n, o, p not run: ")  # not in these rows
    gaps = lines[-1]
    assert gaps == gpu_check.ONE_GPU_GAPS
    for what in ("an abort across ranks", "NCCL's watchdog", "a pending cross-rank receive"):
        assert what in gaps
    named = [w.strip("(),") for w in gaps.split() if w.startswith(("tests/", "(tests/"))]
    assert len(named) == 5 and all((ROOT / p).is_file() for p in named), named


def _make_n(*args: str) -> str:
    if shutil.which("make") is None:
        pytest.skip("no make on this machine")
    done = subprocess.run(["make", "-n", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=60, check=True)
    return done.stdout


def test_make_gpu_check_with_python_runs_it_as_it_is() -> None:
    dry = _make_n("gpu-check", "PYTHON=python3")
    assert "venv" not in dry and "pip" not in dry  # nothing built, nothing fetched
    assert "timeout -k 10 360 python3 -m ppsync.checks.gpu.check" in dry


def test_make_gpu_wheels_fetches_what_a_cuda_image_lacks_for_python_3_12() -> None:
    dry = _make_n("gpu-wheels")
    assert "--only-binary=:all: --python-version 3.12" in dry
    assert "--platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64" in dry
    # every dependency of ppsync but torch and numpy (the image's own), as pyproject says
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    names = {re.split(r"[<>=!~ \[]", d, maxsplit=1)[0] for d in deps} - {"torch", "numpy"}
    assert names == {"pydantic", "anyio", "jsonschema"}
    for dep in deps:
        if not dep.startswith(("torch", "numpy")):
            assert f"'{dep}'" in dry, dep
