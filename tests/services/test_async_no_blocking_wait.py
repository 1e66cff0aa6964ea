"""The async services never block the loop thread in a transfer's wait.

torch marks a gloo work's future done, and runs its callbacks, before the
work reports ``is_completed()``. A loop woken by the callback that then asked
the work (and called ``work.wait(timeout)`` when it said "not yet") blocked
the loop thread: P = 2, D = 1, 3000 steps showed 59 such waits of 4904 on
asyncio (up to 3.6 ms) and 101 on trio. Completion is now read from the
future's own state.

Each rank counts, on its loop's thread, every ``Work.wait`` call made on a
work that has not completed: such a call blocks. There must be none, and
delivery must stay exact.
"""

from __future__ import annotations

import functools
import threading

import pytest
import torch.distributed as dist

from ppsync.core.wire.groups import token_group
from ppsync.harness.driver import Framework, run_async_rank_blocking, workload_config
from ppsync.harness.launcher import RankEnv, spawn_ranks
from ppsync.schemas.config import SyncConfig

STEPS = 1500
TIMEOUT_S = 20.0


def _counting_rank(framework: Framework, env: RankEnv) -> tuple[int, int, int]:
    """(blocking waits on the loop thread, waits in all, faults)."""
    loop_thread = threading.get_ident()
    counts = [0, 0]
    original = dist.Work.wait

    def counted(self: dist.Work, *args: object, **kwargs: object) -> bool:
        if threading.get_ident() == loop_thread:
            counts[1] += 1
            counts[0] += not self.is_completed()
        return bool(original(self, *args, **kwargs))  # type: ignore[arg-type]

    dist.Work.wait = counted  # type: ignore[method-assign]
    config = SyncConfig.build(pp_size=2, max_num_reqs=64, ring_depth=1, timeout_s=TIMEOUT_S)
    group = token_group(dist.group.WORLD, timeout_s=TIMEOUT_S)  # type: ignore[arg-type]
    wcfg = workload_config(config, steps=STEPS, seed=9, max_arrivals=8)
    report = run_async_rank_blocking(config, group, wcfg, framework, env.failure_board(group))
    faults = report.lost + report.stale + report.duplicated + report.corrupt
    return counts[0], counts[1], faults


@pytest.mark.parametrize("framework", ["asyncio", "trio"])
def test_no_wait_blocks_the_loop_thread(framework: Framework) -> None:
    results = spawn_ranks(functools.partial(_counting_rank, framework), 2, timeout_s=TIMEOUT_S)
    for rank, (blocking, waits, faults) in enumerate(results):
        print(f"{framework} rank {rank}: {blocking} blocking of {waits} Work.wait calls")
        assert blocking == 0, (rank, blocking, waits)
        assert faults == 0, (rank, faults)
