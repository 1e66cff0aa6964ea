"""The anyio services on real gloo ranks: the synthetic workload arrives exactly
once and intact on every receiver, on asyncio and on trio.

Each rank process runs its own ``anyio.run`` (through
``run_async_rank_blocking``, as ``ppsync launch --async`` does), so the event
loop framework is a parameter of the rank target, not the anyio_backend
fixture. Every run is bounded by ``spawn_ranks(timeout_s=...)``.
"""

from __future__ import annotations

import functools

import pytest
import torch.distributed as dist
from twin_mode import Mode, check_engine_stream, in_mode, mode_group

from ppsync.core.wire.groups import token_group
from ppsync.harness.driver import Framework, run_async_rank_blocking, workload_config
from ppsync.harness.launcher import RankEnv, spawn_ranks
from ppsync.schemas.config import SyncConfig
from ppsync.schemas.run_report import RankReport

TIMEOUT_S = 20.0
STEPS = 160
SEED = 11

# Aborts and preemptions free request slots while their rows are in flight
# (and the slots are reused at once); long prompts in short chunks give steps
# with no transfer; a short idle period gives empty batches.
KNOBS: dict[str, object] = {
    "arrival_p": 0.6,
    "abort_p": 0.06,
    "preempt_p": 0.02,
    "prompt_len": (1, 48),
    "max_tokens": (1, 12),
    "chunk": (2, 8),
    "idle_every": 25,
}



def _delivery_rank(config: SyncConfig, framework: Framework, mode: Mode,
                   env: RankEnv) -> RankReport:
    # as ppsync.harness.local_run._rank does: a token group, a failure board in the
    # parent's store, the anyio services under anyio.run on ``framework``
    group = token_group(dist.group.WORLD, timeout_s=config.timeout_s)  # type: ignore[arg-type]
    mode_group(group, mode)
    wcfg = workload_config(config, steps=STEPS, seed=SEED, **KNOBS)
    report = run_async_rank_blocking(config, group, wcfg, framework, env.failure_board(group))
    check_engine_stream(mode)
    return report


# (P, K, D or 0 for pp_size, framework, completion mode)
CASES: list[tuple[int, int, int, Framework, Mode]] = [
    (2, 0, 0, "asyncio", "gloo"),
    (2, 3, 0, "trio", "gloo"),
    (2, 3, 1, "asyncio", "gloo"),
    (3, 0, 0, "trio", "gloo"),
    (3, 3, 0, "asyncio", "gloo"),
    (2, 3, 0, "trio", "twin"),
    (3, 3, 0, "asyncio", "twin"),
    (3, 0, 1, "trio", "twin"),
    (3, 3, 0, "trio", "carried"),
    (2, 2, 1, "asyncio", "carried"),
]


@pytest.mark.parametrize(
    ("pp_size", "spec", "ring_depth", "framework", "mode"),
    CASES,
    ids=[f"P{p}-K{k}-D{d or p}-{b}-{m}" for p, k, d, b, m in CASES],
)
def test_async_services_deliver_exactly_once(
    pp_size: int, spec: int, ring_depth: int, framework: Framework, mode: Mode
) -> None:
    config = in_mode(SyncConfig.build(
        pp_size=pp_size, max_num_reqs=16, num_speculative_steps=spec,
        ring_depth=ring_depth or None, timeout_s=TIMEOUT_S,
    ), mode)
    reports = spawn_ranks(
        functools.partial(_delivery_rank, config, framework, mode), pp_size, timeout_s=TIMEOUT_S
    )

    assert [r.rank for r in reports] == list(range(pp_size))
    assert [r.role for r in reports] == ["receiver"] * (pp_size - 1) + ["last"]
    last = reports[-1]
    assert last.rows_sent > 0, last
    for r in reports:
        assert r.steps == STEPS
        # every rank took the same transfer decision on every step
        assert r.transfers == last.transfers > 0, r
    for r in reports[:-1]:
        assert (r.lost, r.stale, r.duplicated, r.corrupt) == (0, 0, 0, 0), r
        assert r.rows_delivered == r.rows_expected > 0, r
        assert r.rows_expected <= last.rows_sent, r
    # every receiver saw the same rows
    assert len({(r.rows_expected, r.rows_delivered) for r in reports[:-1]}) == 1
