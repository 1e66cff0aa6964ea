"""The heartbeat probe (``python -m ppsync.probes.heartbeat_cost``, measured.md
"Heartbeats") runs end to end: both its runs, with and without a board, on
real gloo ranks (it once failed at its second run: the first run's path
closed with transfers in flight on the group the second one reused)."""

from __future__ import annotations

import pytest

from ppsync.probes import heartbeat_cost


def test_the_heartbeat_probe_runs_with_and_without_a_board(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert heartbeat_cost.main(["--pp-size", "3", "--seconds", "1", "--load", "0"]) == 0
    out = capsys.readouterr().out
    assert " board " in out and " none " in out, out
    assert "beat intervals" in out, out
