"""``ppsync.services.awaiting.await_work`` on real gloo work, on asyncio and trio.

- A work that has already completed returns without awaiting anything: run
  inside an already-cancelled scope, it still returns (any checkpoint would
  raise the cancellation). One rank, its own one-rank gloo world.
- A pending work is reached by notification: a deadline shorter than the
  peer's delay is a SyncTimeout, a cancelled wait leaves the work untouched,
  and a later wait returns once the peer's data arrived (two ranks).
"""

from __future__ import annotations

import functools
import re
import time
from dataclasses import dataclass

import anyio
import pytest
import torch
import torch.distributed as dist

from ppsync.core.wire.transport import broadcast_async
from ppsync.errors import SyncTimeout
from ppsync.harness.driver import Framework
from ppsync.harness.launcher import RankEnv, spawn_ranks
from ppsync.services.awaiting import await_work

TIMEOUT_S = 10.0



def _world() -> dist.ProcessGroup:
    group = dist.group.WORLD
    assert group is not None
    return group


# -- an already-completed work ----------------------------------------------------


async def _returns_without_waiting(work: dist.Work) -> bool:
    reached = False
    with anyio.CancelScope() as scope:
        scope.cancel()
        await await_work(work, timeout_s=1.0, what="rank 0: test broadcast")
        reached = True  # only if await_work() never reached a checkpoint
    return reached and not scope.cancelled_caught


def _completed_rank(framework: Framework, env: RankEnv) -> tuple[bool, bool, list[int]]:
    buf = torch.arange(4, dtype=torch.int64)
    work = broadcast_async(buf, 0, _world())
    work.wait()
    done_before = work.is_completed()
    returned = anyio.run(_returns_without_waiting, work, backend=framework)
    return done_before, returned, buf.tolist()


@pytest.mark.parametrize("framework", ["asyncio", "trio"])
def test_completed_work_returns_without_waiting(framework: Framework) -> None:
    [(done_before, returned, data)] = spawn_ranks(
        functools.partial(_completed_rank, framework), 1, timeout_s=TIMEOUT_S
    )
    assert done_before
    assert returned
    assert data == [0, 1, 2, 3]


# -- a pending work ------------------------------------------------------------------

PEER_DELAY_S = 0.6
SHORT_S = 0.2


@dataclass(frozen=True, slots=True)
class Waits:
    """The receiver's three waits on one pending receive."""

    timeout: tuple[str, str]  # (type name, message) of the short wait
    cancelled_pending: bool  # the work was still pending after the cancelled wait
    final_s: float  # from the start to the final wait's return
    data: list[int]


async def _three_waits(work: dist.Work, buf: torch.Tensor) -> Waits:
    start = time.perf_counter()
    what, peer = "rank 0: test receive", 1
    timeout = ("", "")
    try:
        await await_work(work, timeout_s=SHORT_S, what=what, peers=(peer,))
    except SyncTimeout as e:
        timeout = (type(e).__name__, str(e))
    with anyio.move_on_after(0.1):
        await await_work(work, timeout_s=TIMEOUT_S, what=what, peers=(peer,))
    pending = not work.is_completed()
    await await_work(work, timeout_s=TIMEOUT_S, what=what, peers=(peer,))
    return Waits(timeout, pending, time.perf_counter() - start, buf.tolist())


def _pending_rank(framework: Framework, env: RankEnv) -> Waits | None:
    if env.rank == 1:
        time.sleep(PEER_DELAY_S)
        work = broadcast_async(torch.tensor([7, 8, 9], dtype=torch.int64), 1, _world())
        work.wait()
        return None
    buf = torch.zeros(3, dtype=torch.int64)
    work = broadcast_async(buf, 1, _world())
    return anyio.run(_three_waits, work, buf, backend=framework)


@pytest.mark.parametrize("framework", ["asyncio", "trio"])
def test_pending_work_times_out_survives_cancel_then_completes(framework: Framework) -> None:
    waits, _ = spawn_ranks(functools.partial(_pending_rank, framework), 2, timeout_s=TIMEOUT_S)
    assert waits is not None
    kind, message = waits.timeout
    assert kind == "SyncTimeout", waits
    assert re.fullmatch(r"rank 0: test receive: no completion within timeout_s = 0\.2 of the "
                        r"wait", message), message
    # neither the timeout nor the cancellation touched the work: it was still
    # pending, and the next wait got the peer's data
    assert waits.cancelled_pending, waits
    assert waits.data == [7, 8, 9], waits
    assert waits.final_s < TIMEOUT_S / 2, waits
