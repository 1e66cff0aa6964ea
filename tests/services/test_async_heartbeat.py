"""A pending receive does not block the event loop.

P = 2: the last rank sleeps before publishing one step; meanwhile the
receiver awaits ``take()`` for that step while a heartbeat task in the same
task group keeps beating. The late step still arrives intact.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass

import anyio
import pytest
import torch
import torch.distributed as dist
from helpers import decode_view

from ppsync.core import SampledStep
from ppsync.core.wire.groups import token_group
from ppsync.harness.driver import Framework
from ppsync.harness.launcher import RankEnv, spawn_ranks
from ppsync.schemas.config import SyncConfig
from ppsync.services.runtime import open_rank

TIMEOUT_S = 10.0
STEPS = 6
LATE = 3  # the step the last rank publishes late
LATE_S = 0.5
BEAT_S = 0.01
IDX = [2, 0, 5]  # request slots of every step's rows





def _tokens(step: int, n: int) -> list[int]:
    return [1000 * step + 7 * row for row in range(n)]


@dataclass(frozen=True, slots=True)
class Take:
    """One take() on the receiver, as seen from its event loop."""

    step: int  # engine step of the take (it releases step - D)
    wait_s: float
    beats: int  # heartbeats that ran while take() was pending
    tokens: tuple[int, ...]  # first token column of each row; () for None
    idx: tuple[int, ...]


async def _last(config: SyncConfig, group: dist.ProcessGroup) -> list[Take]:
    n = len(IDX)
    async with open_rank(config, group) as rank:
        for t in range(STEPS):
            if t == LATE:
                await anyio.sleep(LATE_S)
            await rank.publish(decode_view(IDX), SampledStep(
                torch.tensor(_tokens(t, n), dtype=torch.int64).reshape(n, 1),
                torch.ones(n, dtype=torch.int32), torch.zeros(n, dtype=torch.int32)))
    return []


async def _receiver(config: SyncConfig, group: dist.ProcessGroup) -> list[Take]:
    beats = 0
    takes: list[Take] = []

    async def heartbeat() -> None:
        nonlocal beats
        while True:
            await anyio.sleep(BEAT_S)
            beats += 1

    async with open_rank(config, group) as rank, anyio.create_task_group() as tg:
        tg.start_soon(heartbeat)
        for t in range(STEPS + config.depth):
            before, t0 = beats, time.perf_counter()
            released = await rank.take()
            wait_s, during = time.perf_counter() - t0, beats - before
            if released is None:
                takes.append(Take(t, wait_s, during, (), ()))
            else:
                takes.append(Take(
                    t, wait_s, during,
                    tuple(int(x) for x in released.sampled_tokens[:, 0]),
                    tuple(int(x) for x in released.idx_mapping),
                ))
            # after the last step, empty batches drain the ring (no transfer)
            await rank.post(decode_view(IDX if t < STEPS else []))
        tg.cancel_scope.cancel()
    return takes


def _heartbeat_rank(config: SyncConfig, framework: Framework, env: RankEnv) -> list[Take]:
    group = token_group(dist.group.WORLD, timeout_s=config.timeout_s)  # type: ignore[arg-type]
    main = _last if env.rank == config.pp_size - 1 else _receiver
    return anyio.run(main, config, group, backend=framework)


@pytest.mark.parametrize("framework", ["asyncio", "trio"])
def test_loop_keeps_running_while_a_receive_waits_for_a_late_peer(framework: Framework) -> None:
    config = SyncConfig.build(pp_size=2, max_num_reqs=8, timeout_s=TIMEOUT_S)
    depth = config.depth
    takes, _ = spawn_ranks(
        functools.partial(_heartbeat_rank, config, framework), 2, timeout_s=TIMEOUT_S
    )
    assert [tk.step for tk in takes] == list(range(STEPS + depth))
    # the first D takes find empty ring slots; then every step arrives exactly
    assert all(tk.tokens == () for tk in takes[:depth])
    for tk in takes[depth:]:
        sent = tk.step - depth
        assert tk.tokens == tuple(_tokens(sent, len(IDX))), tk
        assert tk.idx == tuple(IDX), tk

    late = takes[LATE + depth]
    # the receiver really waited for the late step (half the delay at least:
    # the ranks start their loops within milliseconds of each other) ...
    assert late.wait_s >= LATE_S / 2, late
    # ... and its loop kept beating meanwhile (~50 beats at 10 ms; a blocked
    # loop would give 0 or 1)
    assert late.beats >= 15, late
