"""ppsync.harness.rank.Progress: rank 0's progress line; its clock starts at
the first step, and its rate reads against the run's own steps and wall time."""

from __future__ import annotations

import io
import re

import pytest

from ppsync.harness.local_run import run_local
from ppsync.harness.rank import Progress
from ppsync.schemas.config import SyncConfig

LINE = re.compile(r"ppsync: step (\d+)/(\d+)(?: \((\d+) \+ (\d+) drain\))?  (\d+) steps/s  "
                  r"ETA (\d+) s")


def test_line_says_steps_asked_for_drain_rate_and_eta() -> None:
    out = io.StringIO()
    progress = Progress(1000, every_s=0.0, out=out, drain=3)
    progress(0)  # the first step starts the clock: no line yet
    assert out.getvalue() == ""
    progress(249)
    m = LINE.fullmatch(out.getvalue().rstrip("\n"))
    assert m is not None, out.getvalue()
    assert m.group(1, 2, 3, 4) == ("250", "1003", "1000", "3")


def test_no_drain_part_without_drain_steps() -> None:
    out = io.StringIO()
    progress = Progress(10, every_s=0.0, out=out)
    progress(0)
    progress(4)
    assert re.fullmatch(r"ppsync: step 5/10  \d+ steps/s  ETA \d+ s\n", out.getvalue())


def test_rate_reads_against_the_runs_steps_and_wall_time(
        capfd: pytest.CaptureFixture[str]) -> None:
    """A real two-rank run: rank 0's last line says the steps done and a
    rate measured over those steps alone, so rate x the rank's own wall
    time (its step loop, setup excluded) is at least the steps it counted.
    A clock started before the group and the handshake gives far less."""
    steps, config = 60, SyncConfig.build(pp_size=2, max_num_reqs=8, timeout_s=30.0)
    report = run_local(config, steps=steps, progress_s=0.0)
    lines = [m for line in capfd.readouterr().err.splitlines()
             if (m := LINE.fullmatch(line)) is not None]
    assert lines, "rank 0 printed no progress line"
    last = lines[-1]
    done, total, asked, drain, rate = (int(last.group(i) or 0) for i in (1, 2, 3, 4, 5))
    assert (total, asked, drain) == (steps + config.depth, steps, config.depth)
    assert done == steps + config.depth  # the last call is the drain's last step
    wall_s = next(r.wall_s for r in report.ranks if r.global_rank == 0)
    assert rate + 0.5 >= (done - 1) / wall_s, (rate, done, wall_s)
