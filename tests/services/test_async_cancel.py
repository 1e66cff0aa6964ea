"""Cancellation and body errors inside ``open_rank`` on real gloo ranks.

The engine cancels its task group mid-run (after some steps, or at a
deadline while a ``take()`` is pending), at different points on different
ranks: every rank leaves ``open_rank`` at once, without waiting for the
abandoned transfers, and ppsync leaves no Python thread behind. A rank that
leaves posts it on the failure board, so a peer still waiting on it ends with
PeerLost naming it instead of waiting for its own deadline. An error in
the body leaves the block as itself, not wrapped in an exception group. A
``take()`` cancelled while waiting consumes nothing and can be called again.

Ranks meet at a barrier on the world group (not the token group) before
they exit, so no rank sees a peer's process vanish while it is still inside
``open_rank``: what is tested is cancellation, not a lost peer.
"""

from __future__ import annotations

import functools
import re
import threading
import time
from dataclasses import dataclass

import anyio
import anyio.lowlevel
import pytest
import torch
import torch.distributed as dist
from helpers import decode_view, engine_step
from twin_mode import Mode, in_mode, mode_group

from ppsync.core import SampledStep
from ppsync.core.wire.groups import token_group
from ppsync.errors import PeerLost
from ppsync.harness.driver import Framework, StepLoop, workload_config
from ppsync.harness.launcher import RankEnv, spawn_ranks
from ppsync.schemas.config import SyncConfig
from ppsync.services.runtime import open_rank

TIMEOUT_S = 10.0  # collectives; far above every cancel deadline below
START_S = 5.0  # room for start-up (the deadlines count from inside open_rank)
MAX_STEPS = 300
SEED = 5



def _group(config: SyncConfig) -> dist.ProcessGroup:
    return token_group(dist.group.WORLD, timeout_s=config.timeout_s)  # type: ignore[arg-type]


def _threads() -> list[str]:
    return sorted(f"{t.name}:{t.ident}" for t in threading.enumerate())


# -- cancelling the engine's task group mid-run ----------------------------------


@dataclass(frozen=True, slots=True)
class Stop:
    """When one rank's engine cancels its task group."""

    after_steps: int  # cancel once this many steps ran ...
    deadline_s: float  # ... or at this deadline, whichever comes first


@dataclass(frozen=True, slots=True)
class CancelReport:
    """What one rank saw, returned to the parent."""

    steps: int  # steps completed before the cancel
    by: str  # "steps", "deadline", "left:<rank>" (PeerLost naming a rank that left); "" if none
    leave_s: float  # from the cancel to being out of open_rank
    faults: tuple[int, int, int, int]  # lost, stale, duplicated, corrupt before the cancel
    rows_delivered: int
    threads_before: list[str]  # after the groups exist, before anyio.run
    threads_left: list[str]  # just out of open_rank, inside the loop
    threads_after: list[str]  # after anyio.run returned


async def _engine(
    config: SyncConfig, group: dist.ProcessGroup, stop: Stop
) -> tuple[CancelReport, list[str]]:
    wcfg = workload_config(config, steps=MAX_STEPS, seed=SEED)
    loop = StepLoop(wcfg, config.pp_size - 1 == dist.get_rank(group))
    steps, by, cancelled_at = 0, "", 0.0
    with anyio.move_on_after(stop.deadline_s + START_S) as deadline:
        try:
            async with anyio.create_task_group() as tg, open_rank(config, group) as rank:
                # the deadline counts from the block (start-up takes its own time)
                deadline.deadline = anyio.current_time() + stop.deadline_s
                for t in range(MAX_STEPS):
                    if t == stop.after_steps:
                        by, cancelled_at = "steps", anyio.current_time()
                        tg.cancel_scope.cancel()
                    await engine_step(rank, loop, t)
                    steps += 1
        except* PeerLost as group:
            lost = group.exceptions[0]
            assert isinstance(lost, PeerLost)
            by, cancelled_at = f"left:{lost.peer}", anyio.current_time()
    left = anyio.current_time()
    threads_left = _threads()
    if deadline.cancelled_caught:
        by, cancelled_at = "deadline", deadline.deadline
    tl = loop.checker.tally
    result = CancelReport(
        steps, by, left - cancelled_at if by else 0.0,
        (tl.lost, tl.stale, tl.duplicated, tl.corrupt), tl.delivered, [], [], [],
    )
    return result, threads_left


def _cancel_rank(
    config: SyncConfig, stops: list[Stop], framework: Framework, mode: Mode, env: RankEnv
) -> CancelReport:
    group = mode_group(_group(config), mode)
    before = _threads()
    try:
        result, left = anyio.run(_engine, config, group, stops[env.rank], backend=framework)
        after = _threads()
    finally:
        dist.barrier()  # world group: nobody exits while a peer is still inside
    return CancelReport(
        result.steps, result.by, result.leave_s, result.faults, result.rows_delivered,
        before, left, after,
    )


# Per rank, in rank order (the last rank is last).
PLANS: dict[str, list[Stop]] = {
    # the last rank stops publishing; receivers are cancelled at their deadlines
    # while take() waits for a frame that will never come
    "last-first": [Stop(MAX_STEPS, 0.8), Stop(MAX_STEPS, 1.0), Stop(25, 2.0)],
    # receivers stop at different steps; the last rank is cancelled later
    "receivers-first": [Stop(12, 2.0), Stop(30, 1.2), Stop(60, 1.5)],
    # P = 2, the last rank's own deadline cuts it while its watcher has sends
    # pending on a receiver that stopped
    "p2-receiver-first": [Stop(20, 2.0), Stop(MAX_STEPS, 0.8)],
}
CANCEL_CASES: list[tuple[str, Framework, Mode]] = [
    ("last-first", "asyncio", "gloo"),
    ("receivers-first", "trio", "gloo"),
    ("p2-receiver-first", "asyncio", "gloo"),
    ("last-first", "trio", "gloo"),
    ("last-first", "asyncio", "twin"),
    ("p2-receiver-first", "trio", "twin"),
]


@pytest.mark.parametrize(("plan", "framework", "mode"), CANCEL_CASES)
def test_cancelled_engine_leaves_open_rank_at_once(plan: str, framework: Framework,
                                                   mode: Mode) -> None:
    stops = PLANS[plan]
    pp_size = len(stops)
    config = in_mode(SyncConfig.build(pp_size=pp_size, max_num_reqs=16, timeout_s=TIMEOUT_S),
                     mode)
    # spawn_ranks returning at all means no rank hung inside open_rank
    results = spawn_ranks(
        functools.partial(_cancel_rank, config, stops, framework, mode), pp_size,
        timeout_s=TIMEOUT_S
    )
    for rank, (stop, r) in enumerate(zip(stops, results, strict=True)):
        assert r.by in ("steps", "deadline") or r.by.startswith("left:"), (rank, r)
        if r.by == "steps":
            assert r.steps == stop.after_steps, (rank, r)
        assert r.steps < MAX_STEPS, (rank, r)
        # out of the block at once: nothing waited for the abandoned transfers
        # (their collectives would only fail at TIMEOUT_S)
        assert 0.0 <= r.leave_s < 2.0, (rank, r)
        # ppsync added no Python thread, and left none behind
        assert r.threads_left == r.threads_before, (rank, r)
        assert r.threads_after == r.threads_before, (rank, r)
    for r in results[:-1]:
        # what was released before the cancel was exact
        assert r.faults == (0, 0, 0, 0), r
        assert r.rows_delivered > 0, r
    if plan == "last-first":
        # the receivers waited in take() for frames that never came, until the
        # board told them the last rank (global 2) had left (or, on a slow
        # start, until their own deadline came first)
        assert results[2].by == "steps", results
        assert all(r.by in ("left:2", "deadline") for r in results[:2]), results
    if plan == "receivers-first":
        # rank 0 left first; the others stop by their own plan or on learning it
        assert results[0].by == "steps", results
        assert all(r.by in ("steps", "deadline", "left:0") for r in results[1:]), results
    if plan == "p2-receiver-first":
        # blocked on sends the stopped receiver never matched, until the board
        # told the last rank that rank 0 had left
        assert [r.by for r in results] == ["steps", "left:0"], results


# -- an error in the body ----------------------------------------------------------

FAIL_AT = 4


async def _failing_body(config: SyncConfig, group: dist.ProcessGroup) -> None:
    wcfg = workload_config(config, steps=MAX_STEPS, seed=SEED)
    loop = StepLoop(wcfg, config.pp_size - 1 == dist.get_rank(group))
    async with open_rank(config, group) as rank:
        for t in range(MAX_STEPS):
            if t == FAIL_AT:
                raise ValueError(f"engine failed at step {t} on rank {rank.rank}")
            await engine_step(rank, loop, t)


def _failing_rank(config: SyncConfig, framework: Framework, env: RankEnv) -> tuple[str, str]:
    group = _group(config)
    try:
        anyio.run(_failing_body, config, group, backend=framework)
    except Exception as e:  # an ExceptionGroup would land here too, under its own name
        return type(e).__name__, str(e)
    finally:
        dist.barrier()
    return "", "the body did not raise"


@pytest.mark.parametrize("framework", ["asyncio", "trio"])
def test_body_error_leaves_open_rank_as_itself(framework: Framework) -> None:
    config = SyncConfig.build(pp_size=2, max_num_reqs=16, timeout_s=TIMEOUT_S)
    results = spawn_ranks(
        functools.partial(_failing_rank, config, framework), 2, timeout_s=TIMEOUT_S
    )
    for rank, (kind, message) in enumerate(results):
        # the ValueError itself, not an ExceptionGroup around it
        assert kind == "ValueError", (rank, kind, message)
        assert re.fullmatch(rf"engine failed at step {FAIL_AT} on rank {rank}", message), message


# -- a take() cancelled while waiting ------------------------------------------------

IDX = [3, 1]
LATE_S = 0.6




@dataclass(frozen=True, slots=True)
class Retake:
    first: str  # what the take cancelled while waiting gave: "cancelled" or "returned"
    first_wait_s: float
    tokens: tuple[int, ...]  # the second take's first token column
    idx: tuple[int, ...]


async def _retake(config: SyncConfig, group: dist.ProcessGroup) -> Retake | None:
    n = len(IDX)
    async with open_rank(config, group) as rank:
        if rank.is_last:
            await anyio.sleep(LATE_S)
            await rank.publish(decode_view(IDX), SampledStep(
                torch.tensor([[41], [42]], dtype=torch.int64), torch.ones(n, dtype=torch.int32),
                torch.zeros(n, dtype=torch.int32)))
            return None
        assert await rank.take() is None  # the ring starts empty (D = 1)
        await rank.post(decode_view(IDX))
        first, t0 = "cancelled", time.perf_counter()
        with anyio.move_on_after(0.1):
            await rank.take()  # the frame is LATE_S away
            first = "returned"
        first_wait_s = time.perf_counter() - t0
        released = await rank.take()  # the same slot, still at the ring's head
        assert released is not None
        return Retake(
            first, first_wait_s,
            tuple(int(x) for x in released.sampled_tokens[:, 0]),
            tuple(int(x) for x in released.idx_mapping),
        )


def _retake_rank(config: SyncConfig, framework: Framework, env: RankEnv) -> Retake | None:
    return anyio.run(_retake, config, _group(config), backend=framework)


@pytest.mark.parametrize("framework", ["asyncio", "trio"])
def test_take_cancelled_while_waiting_consumes_nothing(framework: Framework) -> None:
    config = SyncConfig.build(pp_size=2, max_num_reqs=8, ring_depth=1, timeout_s=TIMEOUT_S)
    receiver, last = spawn_ranks(
        functools.partial(_retake_rank, config, framework), 2, timeout_s=TIMEOUT_S
    )
    assert last is None
    assert receiver is not None
    assert receiver.first == "cancelled", receiver
    assert receiver.first_wait_s < LATE_S, receiver
    assert receiver.tokens == (41, 42), receiver
    assert receiver.idx == tuple(IDX), receiver


# -- idle steps are checkpoints --------------------------------------------------------

IDLE_STEPS = 200
CANCEL_AT = 10


async def _idle_loop(config: SyncConfig, group: dist.ProcessGroup) -> tuple[int, int]:
    """Run empty steps (no transfer) through ppsync only; cancel at CANCEL_AT.
    Returns (steps begun after the cancel, sibling beats during the loop)."""
    after_cancel, beats = 0, 0
    empty = decode_view([])
    none_sampled = SampledStep(torch.zeros((0, 1), dtype=torch.int64),
                               torch.zeros(0, dtype=torch.int32), torch.zeros(0, dtype=torch.int32))

    async def sibling() -> None:
        nonlocal beats
        while True:
            await anyio.lowlevel.checkpoint()
            beats += 1

    async with open_rank(config, group) as rank, anyio.create_task_group() as tg:
        tg.start_soon(sibling)
        await anyio.sleep(0.01)  # the sibling is running
        beats = 0
        for t in range(IDLE_STEPS):
            if t == CANCEL_AT:
                tg.cancel_scope.cancel()
            after_cancel += t > CANCEL_AT
            if rank.is_last:
                await rank.publish(empty, none_sampled)
            else:
                await rank.take()
                await rank.post(empty)
    return after_cancel, beats


def _idle_rank(config: SyncConfig, framework: Framework, env: RankEnv) -> tuple[int, int]:
    return anyio.run(_idle_loop, config, _group(config), backend=framework)


@pytest.mark.parametrize("framework", ["asyncio", "trio"])
def test_idle_steps_are_checkpoints(framework: Framework) -> None:
    config = SyncConfig.build(pp_size=2, max_num_reqs=8, ring_depth=1, timeout_s=TIMEOUT_S)
    results = spawn_ranks(
        functools.partial(_idle_rank, config, framework), 2, timeout_s=TIMEOUT_S
    )
    for rank, (after_cancel, beats) in enumerate(results):
        # the cancel takes effect at the next ppsync call ...
        assert after_cancel == 0, (rank, after_cancel)
        # ... and every call lets other tasks run
        assert beats >= CANCEL_AT // 2, (rank, beats)
