"""The host carrier (ppsync.core.codec.carriers) on the CPU twin of a CUDA
device whose streams run far behind the host: no thread ever waits for a
frame's copy to pinned memory, no pinned buffer is taken again before the
copy that last used it ended, and every row still arrives exactly once.

The twin's side streams start each piece of work ``LAG_S`` after it was
handed over (ten times tests/twin_mode.py's), so nearly every send is
queued behind its copy and issued later, by a later call or by the rank's
watcher: the test checks that it was (``deferred``), or it would prove nothing.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
from twin_mode import check_engine_stream, in_mode

from ppsync.core.codec.carriers import STATS as COPY_STATS
from ppsync.core.codec.carriers import HostCarrier
from ppsync.core.frame.layout import FrameLayout
from ppsync.core.path.token_path import TokenPath
from ppsync.core.wire.completion import emulate
from ppsync.core.wire.completion.twin_streams import TwinPlatform
from ppsync.core.wire.groups import token_group
from ppsync.harness.driver import run_sync_rank, workload_config
from ppsync.harness.launcher import RankEnv, spawn_ranks
from ppsync.schemas.config import SyncConfig
from ppsync.schemas.run_report import RankReport

LAG_S = 0.02
STEPS = 200


def _rank(config: SyncConfig, env: RankEnv) -> tuple[RankReport, int]:
    group = token_group(dist.group.WORLD, timeout_s=config.timeout_s)  # type: ignore[arg-type]
    emulate(group, "nccl", carrier="host", lag_s=LAG_S)
    path = TokenPath(in_mode(config, "carried"), group)
    assert not path.completion.stream_ordered  # gloo's works judge the transfers
    report = run_sync_rank(path, workload_config(config, steps=STEPS, seed=3, arrival_p=0.7,
                                                 max_tokens=(1, 10), idle_every=40))
    check_engine_stream("carried")  # no copy waited on, no pinned buffer reused early
    return report, COPY_STATS.deferred


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("pp_size", "spec", "ring_depth"), [(2, 0, 1), (3, 3, 0)])
def test_no_thread_waits_on_a_copy_however_far_the_device_lags(
        pp_size: int, spec: int, ring_depth: int) -> None:
    config = SyncConfig.build(pp_size=pp_size, max_num_reqs=16, num_speculative_steps=spec,
                              ring_depth=ring_depth or None, timeout_s=20.0)
    out = spawn_ranks(functools.partial(_rank, config), pp_size, timeout_s=100)
    for report, _ in out:
        assert report.lost == report.stale == report.duplicated == report.corrupt == 0
    sent = out[-1][0].rows_sent
    assert sent > 0
    for r, _ in out[:-1]:
        assert r.rows_delivered + r.excluded == sent and r.rows_delivered == r.rows_expected
    deferred = out[-1][1]
    assert deferred > STEPS // 4, f"only {deferred} sends waited for their copy: the lag " \
        "did not hold the frames back, the test shows nothing"


def test_a_pinned_buffer_taken_before_its_copy_ended_is_counted() -> None:
    # the check the suites rely on (check_engine_stream) can fail: a buffer
    # given back while the copy that read it still runs, then taken again
    platform = TwinPlatform(torch.device("cpu"), lag_s=0.3)
    layout = FrameLayout(SyncConfig.build(pp_size=2, max_num_reqs=4, codec="device"))
    carrier = HostCarrier(platform, layout)
    side = platform.new_stream()
    before = COPY_STATS.reused_early
    try:
        wire, _ = carrier.post(platform, side, 2, lambda: torch.empty(0), lambda w: _done())
        platform.run_on(side, lambda: None)  # a copy out of ``wire``, 0.3 s behind
        copied = platform.record_event(side)
        carrier.give(wire, copied)  # as a bug would: the copy has not run yet
        again, _ = carrier.post(platform, side, 2, lambda: torch.empty(0), lambda w: _done())
        assert again is wire  # the pool's one buffer of that size
        assert COPY_STATS.reused_early == before + 1
        copied.synchronize()
        carrier.give(again, copied)
        carrier.post(platform, side, 2, lambda: torch.empty(0), lambda w: _done())
        assert COPY_STATS.reused_early == before + 1  # its copy ended: not early
    finally:
        platform.close_stream(side)
        COPY_STATS.reused_early = before


def _seen_here(env: RankEnv) -> tuple[int, int, int, int]:
    return (COPY_STATS.built, COPY_STATS.reused_early, COPY_STATS.copy_waits,
            COPY_STATS.deferred)


def test_a_forked_rank_starts_with_nothing_seen() -> None:
    # this process built a host carrier (the run report of a rank forked from
    # it must show that rank's own copies, or none: not its parent's)
    platform = TwinPlatform(torch.device("cpu"), lag_s=0.0)
    HostCarrier(platform, FrameLayout(SyncConfig.build(pp_size=2, max_num_reqs=4,
                                                       codec="device")))
    COPY_STATS.copy_waits += 1
    try:
        assert COPY_STATS.built > 0
        assert spawn_ranks(_seen_here, 1, timeout_s=20.0) == [(0, 0, 0, 0)]
    finally:
        COPY_STATS.copy_waits -= 1


def _done() -> dist.Work:
    from ppsync.bench.loopback import LoopWork

    work = LoopWork()
    work.future.set_result(None)
    return work
