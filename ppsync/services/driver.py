"""Drive one rank's synchronous token path with the synthetic workload.

The loop follows the engine order of ``ppsync.core.handler``: consume (non-last
ranks), free slots, schedule, then post or publish. It runs D extra steps with
empty batches at the end so every posted step is consumed and checked.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from ppsync.core.handler import TokenPath
from ppsync.schemas.report import RankReport
from ppsync.services.checker import Checker
from ppsync.services.workload import Workload, WorkloadConfig


def workload_config(path: TokenPath, *, steps: int, seed: int, **knobs: object) -> WorkloadConfig:
    """The workload matching a token path's configuration."""
    c = path.config
    return WorkloadConfig(
        max_num_reqs=c.max_num_reqs,
        num_speculative_steps=c.num_speculative_steps,
        ring_depth=c.depth,
        seed=seed,
        steps=steps,
        **knobs,  # type: ignore[arg-type]
    )


def percentiles_us(samples_ns: np.ndarray) -> tuple[float, float]:
    """(p50, p99) in µs of a sample of durations in ns."""
    if samples_ns.size == 0:
        return 0.0, 0.0
    p50, p99 = np.percentile(samples_ns, [50, 99]) / 1e3
    return float(p50), float(p99)


def run_sync_rank(path: TokenPath, wcfg: WorkloadConfig) -> RankReport:
    """Run ``wcfg.steps`` steps (plus D to drain) and report what was seen."""
    wl = Workload(wcfg)
    checker = Checker(wl)
    depth = wcfg.ring_depth
    K = wcfg.num_speculative_steps
    table = torch.full((wcfg.max_num_reqs, K), -1, dtype=torch.int64) if K else None
    total = wcfg.steps + depth
    blocked_ns = np.zeros(total, dtype=np.int64)
    transfers = rows_sent = 0
    start = time.perf_counter()
    for t in range(total):
        spent = 0
        if not path.is_last:
            t0 = time.perf_counter_ns()
            released = path.consume(table)
            spent = time.perf_counter_ns() - t0
            checker.check(t, released, table)
        for slot in wl.begin_step(t):
            path.free(slot)
        step = wl.schedule(t)
        t0 = time.perf_counter_ns()
        if path.is_last:
            sent = path.publish(
                step.view,
                torch.from_numpy(step.tokens_np[:, : step.width]),
                torch.from_numpy(step.num_sampled_np),
                torch.from_numpy(step.num_rejected_np),
                None if step.drafts_np is None else torch.from_numpy(step.drafts_np),
            )
            rows_sent += sent
        else:
            sent = path.post(step.view)
        blocked_ns[t] = spent + time.perf_counter_ns() - t0
        transfers += sent > 0
    path.close()
    wall = time.perf_counter() - start
    p50, p99 = percentiles_us(blocked_ns[: wcfg.steps])
    tl = checker.tally
    return RankReport(
        rank=path.rank,
        role="last" if path.is_last else "receiver",
        steps=wcfg.steps,
        transfers=transfers,
        rows_sent=rows_sent,
        rows_expected=tl.rows_expected,
        rows_delivered=tl.delivered,
        lost=tl.lost,
        stale=tl.stale,
        duplicated=tl.duplicated,
        corrupt=tl.corrupt,
        sync_us_p50=p50,
        sync_us_p99=p99,
        wall_s=wall,
    )
