"""The async services' bounded inline wait (ppsync.services.awaiting).

Before handing a pending transfer's wait to the event loop, the loop thread
waits inline for it, at most ``INLINE_WAIT_S``, once per wait. On a real run
(P = 2, the async services on asyncio and trio) each rank counts, on its
loop's thread: the inline waits, the bound each was given, and the waits
that reached the inline stage. Every inline wait must be bounded by
``INLINE_WAIT_S``, there must be exactly one per wait that reached it (so the
loop thread is never blocked beyond the bound per wait), none may run off the
loop thread, no ``Work.wait`` may block, and delivery must stay exact. The
counts of waits that ended inline and those handed off are printed (a
measure, not asserted: it depends on the machine's load).
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
from ppsync.services import awaiting

STEPS = 800
TIMEOUT_S = 20.0


def _rank(framework: Framework, env: RankEnv) -> dict[str, float]:
    loop_thread = threading.get_ident()
    counts = {"reached": 0, "inline": 0, "ended_inline": 0, "off_loop": 0,
              "blocking_waits": 0, "max_bound_s": 0.0}
    inline_wait = awaiting.inline_wait
    ended_inline = awaiting._ended_inline
    work_wait = dist.Work.wait

    def counted_inline(flag: threading.Event, bound_s: float) -> bool:
        counts["inline"] += 1
        counts["off_loop"] += threading.get_ident() != loop_thread
        counts["max_bound_s"] = max(counts["max_bound_s"], bound_s)
        ended = inline_wait(flag, bound_s)
        counts["ended_inline"] += ended
        return ended

    def counted_reach(*args: object, **kwargs: object) -> bool:
        counts["reached"] += 1
        return ended_inline(*args, **kwargs)  # type: ignore[arg-type]

    def counted_wait(self: dist.Work, *args: object, **kwargs: object) -> bool:
        if threading.get_ident() == loop_thread:
            counts["blocking_waits"] += not self.is_completed()
        return bool(work_wait(self, *args, **kwargs))  # type: ignore[arg-type]

    awaiting.inline_wait = counted_inline
    awaiting._ended_inline = counted_reach
    dist.Work.wait = counted_wait  # type: ignore[method-assign]
    config = SyncConfig.build(pp_size=2, max_num_reqs=64, ring_depth=1, timeout_s=TIMEOUT_S)
    group = token_group(dist.group.WORLD, timeout_s=TIMEOUT_S)  # type: ignore[arg-type]
    wcfg = workload_config(config, steps=STEPS, seed=11, max_arrivals=8)
    report = run_async_rank_blocking(config, group, wcfg, framework, env.failure_board(group))
    counts["faults"] = report.lost + report.stale + report.duplicated + report.corrupt
    return counts


@pytest.mark.parametrize("framework", ["asyncio", "trio"])
def test_inline_waits_are_bounded_once_per_wait(framework: Framework) -> None:
    results = spawn_ranks(functools.partial(_rank, framework), 2, timeout_s=TIMEOUT_S)
    for rank, c in enumerate(results):
        print(f"{framework} rank {rank}: {c['reached']} waits reached the inline stage, "
              f"{c['ended_inline']} ended inline, {c['reached'] - c['ended_inline']} handed "
              "off to the loop")
        assert c["faults"] == 0, (rank, c)
        assert c["blocking_waits"] == 0, (rank, c)
        assert c["off_loop"] == 0, (rank, c)
        assert c["inline"] == c["reached"], (rank, c)  # one bounded wait per wait, no more
        assert 0 < c["max_bound_s"] <= awaiting.INLINE_WAIT_S, (rank, c)
    # the inline stage is exercised on this run (a pending transfer was awaited)
    assert sum(c["reached"] for c in results) > 0
