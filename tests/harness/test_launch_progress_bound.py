"""``ppsync launch`` bounds a run by its progress, not by a budget for the
whole run: a run whose steps are slower than the old budget's 10 ms x world
each still runs to its end, as long as every rank keeps completing steps."""

from __future__ import annotations

import pytest

from ppsync.harness.driver import StepLoop
from ppsync.harness.local_run import STALL_GRACE_S, run_local
from ppsync.schemas.config import SyncConfig

STEP_S = 0.1  # each step's pause: 5x the old budget's 10 ms x 2 ranks
STEPS = 160
TIMEOUT_S = 2.0


@pytest.mark.timeout(120)
def test_a_run_slower_than_the_old_budget_runs_to_its_end(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # The ranks are forked from this process: they inherit the slow pause.
    # The old bound, timeout_s + steps x (10 ms + jitter) x world + 10 s, is
    # 2 + 160 x 0.02 + 10 = 15.2 s; the steps alone take 16 s.
    monkeypatch.setattr(StepLoop, "pause_s", lambda self: STEP_S)
    assert STEP_S < TIMEOUT_S + STALL_GRACE_S  # every step well within the progress bound
    config = SyncConfig.build(pp_size=2, max_num_reqs=8, timeout_s=TIMEOUT_S)
    report = run_local(config, steps=STEPS, jitter_us=1.0)
    assert report.ok and report.ended is None
    assert all(r.steps == STEPS for r in report.ranks)
