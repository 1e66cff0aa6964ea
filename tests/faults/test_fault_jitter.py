"""Slow and jittery ranks: random per-rank, per-step pauses change when each
rank reaches each collective, never what arrives.

``run_local(..., jitter_us=J)`` pauses every rank a random 0..J µs before each
step (``StepLoop.pause_s``), so ranks drift apart and catch up all the time;
P = 3, K = 3, over the synchronous core and the asyncio services. Then only
one rank is slow (a receiver, or the last rank), through ``run_sync_rank`` /
``run_async_rank_blocking`` with a per-rank jitter. Every receiver must get
every expected row exactly once and intact.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch.distributed as dist
from fault_tools import watchdog

from ppsync.core.path.token_path import TokenPath
from ppsync.core.wire.groups import token_group
from ppsync.harness.driver import (
    Framework,
    run_async_rank_blocking,
    run_sync_rank,
    workload_config,
)
from ppsync.harness.launcher import RankEnv, spawn_ranks
from ppsync.harness.local_run import run_local
from ppsync.schemas.config import SyncConfig
from ppsync.schemas.run_report import RankReport

PP_SIZE = 3
TIMEOUT_S = 20.0
STEPS = 300
SEED = 13
JITTER_US = 500.0  # everyone: 0..0.5 ms per step
SLOW_US = 3000.0  # the one slow rank: 0..3 ms per step
CONFIG = SyncConfig.build(
    pp_size=PP_SIZE, max_num_reqs=32, num_speculative_steps=3, timeout_s=TIMEOUT_S
)
# Busy, churning batches: frequent arrivals, aborts and preemptions reuse
# request slots while their rows are in flight.
KNOBS: dict[str, object] = {"arrival_p": 0.6, "abort_p": 0.03, "preempt_p": 0.01}


def _check_exact(reports: list[RankReport]) -> None:
    assert [r.role for r in reports] == ["receiver"] * (PP_SIZE - 1) + ["last"]
    transfers = {r.transfers for r in reports}
    assert len(transfers) == 1 and transfers.pop() > 0, reports  # one decision per step
    for r in reports:
        assert r.steps == STEPS, r
        assert r.faults == 0, r
    last = reports[-1]
    assert last.rows_sent > 0, last
    for r in reports[:-1]:
        assert r.rows_delivered == r.rows_expected > 0, r
        assert r.rows_expected <= last.rows_sent, r


@pytest.mark.parametrize("framework", [None, "asyncio"], ids=["sync", "asyncio"])
def test_jittery_ranks_deliver_exactly(framework: Framework | None) -> None:
    report = run_local(CONFIG, steps=STEPS, seed=SEED, framework=framework, jitter_us=JITTER_US,
                       knobs=KNOBS)
    assert report.ok, report
    assert report.mode == ("sync" if framework is None else "async")
    _check_exact(report.ranks)


def _pauses_s(rank: int, jitter_us: float) -> float:
    """The total pause ``StepLoop`` injects on ``rank`` over the run (it draws
    from ``default_rng([seed, rank, 7])``, one draw per step)."""
    rng = np.random.default_rng([SEED, rank, 7])
    draws = rng.uniform(0, jitter_us, size=STEPS + CONFIG.depth)
    return float(draws.sum()) / 1e6


def _one_slow_rank(framework: Framework | None, slow: int, env: RankEnv) -> RankReport:
    watchdog(TIMEOUT_S + 8)
    group = token_group(dist.group.WORLD, timeout_s=TIMEOUT_S)  # type: ignore[arg-type]
    board = env.failure_board(group)
    wcfg = workload_config(CONFIG, steps=STEPS, seed=SEED, **KNOBS)
    jitter = SLOW_US if env.rank == slow else 0.0
    if framework is None:
        return run_sync_rank(TokenPath(CONFIG, group, board=board), wcfg, jitter_us=jitter)
    return run_async_rank_blocking(CONFIG, group, wcfg, framework, board, jitter)


ONE_SLOW = [
    pytest.param(None, 0, id="sync-slow-receiver"),
    pytest.param(None, PP_SIZE - 1, id="sync-slow-last"),
    pytest.param("asyncio", 1, id="asyncio-slow-receiver"),
]


@pytest.mark.parametrize(("framework", "slow"), ONE_SLOW)
def test_one_slow_rank_delivers_exactly(framework: Framework | None, slow: int) -> None:
    reports = spawn_ranks(functools.partial(_one_slow_rank, framework, slow), PP_SIZE,
                          timeout_s=TIMEOUT_S)
    _check_exact(reports)
    # the slow rank really was slow: its loop slept at least its pauses
    # (a lower bound that sleeping guarantees, not a timing)
    assert reports[slow].wall_s >= _pauses_s(slow, SLOW_US) > 0.3, reports[slow]
