"""The rank's one watcher thread (ppsync.core.wire.rank_watch), alone: the
order of its first calls (the engine's device set before any query of a
work), and who acts on a failure (never the watcher during an engine call;
never both the watcher and the engine's thread).

The watched path is a stand-in here (what a watcher watches is a protocol);
the multi-rank suites run the watcher over real token paths. One case runs
two real gloo ranks: a finished receive among the watched works."""

from __future__ import annotations

import threading
import time
from contextlib import AbstractContextManager, contextmanager
from typing import Any, cast

import torch
import torch.distributed as dist

from ppsync.core.wire.completion import Completion, HostCompleted
from ppsync.core.wire.heartbeat import LOOK_S
from ppsync.core.wire.platform import Platform
from ppsync.core.wire.rank_watch import RankWatcher
from ppsync.errors import PeerLost, PPSyncError
from ppsync.harness.launcher import RankEnv, spawn_ranks

ROUND_S = 0.3  # a little more than a watcher round while something is pending


class Recorder:
    """What the watcher did, in order, from which thread."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []
        self.lock = threading.Lock()

    def note(self, what: str) -> None:
        with self.lock:
            self.calls.append((what, threading.current_thread().name))


class StandInPlatform(Platform):
    """The CPU platform, noting when a thread enters and when it polls."""

    def __init__(self, rec: Recorder) -> None:
        super().__init__(torch.device("cpu"))
        self.rec = rec

    def enter_thread(self) -> None:
        self.rec.note("set device")

    def capture_safe(self) -> AbstractContextManager[object]:
        @contextmanager
        def mode() -> Any:
            self.rec.note("capture-safe mode")
            yield
        return mode()


class StandInCompletion:
    """A work's end, as asked (never ended: the watcher keeps looking)."""

    stream_ordered = False

    def __init__(self, rec: Recorder) -> None:
        self.rec = rec

    def ended(self, work: object) -> bool:
        self.rec.note("query")
        return False

    def ended_well(self, work: object) -> bool:
        return False


class Watched:
    """One pending work; a failure set by the test."""

    def __init__(self) -> None:
        self.error: PPSyncError | None = None
        self.work = object()

    def outstanding(self) -> list[dist.Work]:
        return [cast(dist.Work, self.work)]

    def step_count(self) -> int:
        return 0

    def fail_in_background(self, err: PPSyncError, observed: bool) -> PPSyncError:
        self.error = self.error or err
        return self.error

    def failure(self) -> PPSyncError | None:
        return self.error

    def tick(self) -> None:
        pass

    def hurry(self) -> bool:
        return False


def _watcher(rec: Recorder, watched: Watched) -> RankWatcher:
    return RankWatcher(watched, board=None, me=0, ranks=[0, 1], peers=[1],
                       completion=cast(Completion, StandInCompletion(rec)),
                       platform=StandInPlatform(rec), silent_s=60.0, max_pending_s=3600.0)


def test_the_watcher_sets_the_device_before_its_first_query() -> None:
    rec = Recorder()
    watcher = _watcher(rec, Watched())
    watcher.start()
    time.sleep(ROUND_S)
    watcher.stop()
    calls = [c for c, thread in rec.calls if thread == "ppsync-watch"]
    assert calls[0] == "set device", calls
    assert calls.count("set device") == 1, calls
    # every query of a work runs inside the capture-safe mode
    assert "query" in calls and calls.index("capture-safe mode") < calls.index("query"), calls


def test_the_watcher_and_the_engine_never_both_act_on_one_failure() -> None:
    rec, watched = Recorder(), Watched()
    watcher = _watcher(rec, watched)
    acts: list[str] = []
    watcher.on_failure = lambda err: acts.append("watcher")
    watcher.start()
    try:
        # found during an engine call: the watcher leaves it to the engine
        with watcher.engine_call():
            watched.error = PeerLost("rank 1 is gone", peer=1)
            time.sleep(3 * ROUND_S)
            assert acts == []
            watcher.act_once(lambda: acts.append("engine"))  # the call raised it: it acts
        time.sleep(3 * ROUND_S)
        assert acts == ["engine"]  # and the watcher, between calls, does not again
        watcher.act_once(lambda: acts.append("engine again"))
        assert acts == ["engine"]
    finally:
        watcher.stop()

    # found between engine calls: the watcher acts, once; the engine's call later does not
    rec, watched = Recorder(), Watched()
    watcher = _watcher(rec, watched)
    acts.clear()
    watcher.on_failure = lambda err: acts.append("watcher")
    watcher.start()
    try:
        watched.error = PeerLost("rank 1 is gone", peer=1)
        time.sleep(3 * ROUND_S)
        with watcher.engine_call():
            watcher.act_once(lambda: acts.append("engine"))
        time.sleep(3 * ROUND_S)
        assert acts == ["watcher"]
    finally:
        watcher.stop()


# -- a finished gloo receive among the works it watches ------------------------------


class Finished(Watched):
    """One real gloo receive, finished and waited for by its owner (SGLang's
    guard hands the watcher such works before it releases them)."""

    def __init__(self, work: dist.Work) -> None:
        super().__init__()
        self.work = work


def _finished_recv_rank(env: RankEnv) -> str:
    msg = torch.zeros(4)
    if env.rank == 0:
        dist.send(torch.ones(4), dst=1)
        dist.barrier()  # rank 1's watcher has had its rounds
        dist.send(torch.full((4,), 2.0), dst=1)
        return "sent"
    work = dist.irecv(msg, src=0)
    assert work is not None
    work.wait()  # the owner's one wait
    watched = Finished(work)
    watcher = RankWatcher(watched, board=None, me=1, ranks=[0, 1], peers=[0],
                          completion=HostCompleted(), platform=Platform(torch.device("cpu")),
                          silent_s=60.0, max_pending_s=3600.0)
    watcher.start()
    time.sleep(4 * LOOK_S + ROUND_S)  # several rounds over the finished receive
    watcher.stop()
    dist.barrier()
    dist.recv(msg, src=0)  # the group still carries the next message
    assert watched.error is None, watched.error
    return f"{msg.tolist()}"


def test_a_finished_gloo_receive_is_not_waited_again_by_the_watcher() -> None:
    # A second wait() on a finished gloo recv waits for another message; its
    # timeout closes every connection of the group ("Application timeout
    # caused pair closure"), so the next receive of the engine fails.
    assert spawn_ranks(_finished_recv_rank, 2, timeout_s=30.0) == ["sent", "[2.0, 2.0, 2.0, 2.0]"]
