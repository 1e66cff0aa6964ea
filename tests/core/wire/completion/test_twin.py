"""The CPU twin of stream-ordered backends on two real gloo ranks: works as
NCCL reports them (future done at enqueue, ``is_completed()`` the truth),
device-side waits, stand-in streams that run later than the host, the
engine-stream count, and abort."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from ppsync.core.wire.completion import STATS, completion_for, emulate
from ppsync.core.wire.completion.semantics import StreamOrdered
from ppsync.core.wire.completion.twin import POISON, TwinWork
from ppsync.core.wire.completion.twin_streams import MAIN, TwinPlatform
from ppsync.core.wire.groups import token_group
from ppsync.core.wire.teardown import keep_until_exit
from ppsync.errors import SyncTimeout
from ppsync.harness.launcher import RankEnv, spawn_ranks

TIMEOUT_S = 10.0
LATE_S = 0.4  # the root sends this late: the receiver's transfer is pending meanwhile


def _never_called(self: TwinWork) -> None:
    raise AssertionError("ppsync called Work.exception(): a TypeError on torch < PR #184697")


def _twin_rank(env: RankEnv) -> dict[str, object]:
    # torch's own binding on the twin's works; ppsync must never call it
    TwinWork.exception = _never_called  # type: ignore[method-assign,assignment]
    group = token_group(dist.group.WORLD, timeout_s=TIMEOUT_S)  # type: ignore[arg-type]
    emulate(group)
    ends = completion_for(group, "gloo")
    issue = ends.broadcaster(group, 1).issue
    bufs = [torch.zeros(4, dtype=torch.int64) for _ in range(3)]
    if env.rank == 1:  # the root: two broadcasts, each late; never a third
        for i in range(2):
            time.sleep(LATE_S)
            bufs[i].fill_(7 + i)
            ends.wait(issue(bufs[i]), timeout_s=TIMEOUT_S, what="send", peer=None)
        return {}
    seen: dict[str, object] = {"name": ends.name}
    p = TwinPlatform(torch.device("cpu"))
    side = p.new_stream()
    # 1. a receive: its future is done at enqueue; only is_completed() tells
    work = issue(bufs[0])
    assert isinstance(work, TwinWork)
    seen["enqueued"] = (work.get_future().done(), work.is_completed())
    # 2. a side stream ordered after it runs what it is handed only after it ended
    read: list[list[int]] = []
    with p.use(side):
        ends.order_after(work)  # device-side: the host does not wait
        p.run_on(side, lambda: read.append(bufs[0].tolist()))
        event = p.record_event(side)
    seen["before_end"] = (list(read), event.query())
    ends.wait(work, timeout_s=TIMEOUT_S, what="receive", peer=None)  # the host polls
    event.synchronize()
    seen["after_end"] = (read[0], work.consumed)
    # 3. the engine's stream made to wait on an unconsumed receive: counted, and
    #    the host (the main stream's stand-in) blocks until it ended
    work = issue(bufs[1])
    before = STATS.engine_waits_unconsumed
    work.get_future().wait()
    seen["main_wait"] = (STATS.engine_waits_unconsumed - before, work.is_completed(),
                         bufs[1].tolist(), MAIN.main)
    # 4. abort: as NCCL reports it, a receive that will never end then reads
    #    completed, without an error, its buffer unfilled (poisoned here);
    #    ppsync's semantics count it failed with the abort's cause
    work = issue(bufs[2])
    with p.use(side):
        work.wait()
        event = p.record_event(side)
    assert isinstance(ends, StreamOrdered)
    ends.abort(group, SyncTimeout("rank 0: receive: no completion", peer=1))
    assert ends.aborter is not None
    ends.aborter.join(TIMEOUT_S)
    event.synchronize()
    assert isinstance(work, TwinWork)
    result = work.get_future_result()
    seen["nccl_after_abort"] = (work.is_completed(), result.done() and result.value(),
                                bufs[2].tolist() == [POISON] * 4, event.query())
    try:
        ends.wait(work, timeout_s=TIMEOUT_S, what="receive", peer=None)
        seen["ppsync_after_abort"] = ("no error", ends.ended_well(work))
    except SyncTimeout as e:
        seen["ppsync_after_abort"] = (str(e), ends.ended_well(work))
    keep_until_exit(group)  # gloo's own receive stays pending until exit
    return seen


def test_the_twin_behaves_as_nccl_reports_its_works() -> None:
    seen = spawn_ranks(_twin_rank, 2, timeout_s=TIMEOUT_S)[0]
    assert seen["name"] == "stream-ordered (twin of nccl)"
    assert seen["enqueued"] == (True, False)  # future done, transfer pending
    assert seen["before_end"] == ([], False)  # the side stream had not run its work
    assert seen["after_end"] == ([7, 7, 7, 7], True)  # ... it read the data, after the end
    assert seen["main_wait"] == (1, True, [8, 8, 8, 8], True)
    # NCCL after ncclCommAbort: completed, success, the buffer never filled
    assert seen["nccl_after_abort"] == (True, 0, True, True)
    after = seen["ppsync_after_abort"]
    assert isinstance(after, tuple)
    assert "aborted earlier" in after[0] and "no completion" in after[0] and not after[1]
