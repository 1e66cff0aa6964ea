"""One watcher thread per rank (docs/design.md, "Slow is not dead").

It is the only poller off the engine's thread. About once a second it
publishes the rank's heartbeat on the failure board (ppsync.core.wire.heartbeat);
while the rank has a transfer pending or a wait under way it reads its
peers' beats and the board's failure count every :data:`LOOK_S`, and looks
at the pending transfers. It fails the rank's path, once, in the background:

- a transfer that ended badly (a lost connection: a dead peer, named within
  about a look);
- a notice another rank posted on the board;
- a rank of the group whose heartbeat stopped for ``silent_s`` (a stopped
  or frozen peer), named within ``silent_s`` + about a second, whatever the
  step time;
- a transfer pending longer than ``max_pending_s`` from its post (a hard
  cap, so the backend's own clock, set above it, never speaks first).

It never bounds a live peer: a wait's own bound (``timeout_s`` from its
start) is the waiting thread's (ppsync.core.wire.waits). Failing the path
means naming the failure through the board, aborting a stream-ordered group
and remembering the error (the watched object does that, under its own
lock, so the watcher and the engine thread never both act on one failure);
the engine's next call, or its current wait, raises it. Where nothing would
call again (an idle vLLM worker), an ``on_failure`` handler acts on it,
under the engine-call lock, only while no engine call runs.

The thread sets the engine's device before any device call (a new thread
starts on device 0: a CUDA context there for every rank that is not) and
queries works only in the platform's capture-safe mode. It holds the works
it watches by reference. Every call into torch is a
ppsync.core.wire.teardown.native_call: the process's exit waits for it.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Protocol

import torch.distributed as dist

from ppsync.core.wire.board import FailureBoard, Relayed
from ppsync.core.wire.completion import Completion
from ppsync.core.wire.heartbeat import BEAT_S, LOOK_S, Activity, Peers
from ppsync.core.wire.platform import Platform
from ppsync.core.wire.teardown import native_call
from ppsync.core.wire.transport import has_future
from ppsync.errors import PPSyncError, SyncTimeout

log = logging.getLogger("ppsync")

STOP_S = 2.0
"""Longest :meth:`RankWatcher.stop` waits for the thread."""
HURRY_S = 0.002
"""The watcher's round while a frame waits for its copy to pinned memory
(the host carrier): the copy takes microseconds on a device, so an idle
engine's frame goes within about this much of its copy."""
DEPENDS_S = 1.0
"""A transfer pending this long (or a wait under way) means the rank now
depends on its peers: a notice on the board or a silent rank then fails its
path in the background. Younger transfers are the usual pipelined flow, and
a path that depends on nothing learns of a failure when it next waits."""


class Watched(Protocol):
    """What a watcher watches: one rank's end of its group."""

    def outstanding(self) -> list[dist.Work]:
        """The works issued and not yet released, as a snapshot (never raises)."""

    def step_count(self) -> int:
        """The rank's steps so far (its beat says which it is in)."""

    def fail_in_background(self, err: PPSyncError, observed: bool) -> PPSyncError:
        """Fail the path for ``err`` (named, posted, aborted: once); the
        error the path now raises."""

    def failure(self) -> PPSyncError | None:
        """The path's failure, once it failed."""

    def tick(self) -> None:
        """Called each round while no engine call runs (frames whose copy
        to pinned memory ended are sent; the vLLM adapter sends a step it
        held for drafts that did not come)."""

    def hurry(self) -> bool:
        """Whether something waits for the next round (a frame for its copy:
        the rounds then come every HURRY_S)."""


class RankWatcher:
    """The watcher thread of one rank (see the module docstring).

    ``me``: this rank's global rank; ``ranks``: its group's global ranks;
    ``stage_of``: a global rank's PP stage; ``peers``: the ranks its
    transfers wait on (named by a wait's timeout)."""

    def __init__(self, watched: Watched, *, board: FailureBoard | None, me: int,
                 ranks: Sequence[int], peers: Sequence[int], completion: Completion,
                 platform: Platform, silent_s: float, max_pending_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.watched = watched
        self.board = board
        self.me = me
        self.others = [r for r in ranks if r != me]
        self.peers = list(peers)
        self.completion = completion
        self.platform = platform
        self.max_pending_s = max_pending_s
        self.clock = clock
        self.activity = Activity(clock)
        """What this rank's beats say it is doing."""
        stages = {r: i for i, r in enumerate(ranks)}
        self.peer_view = Peers(silent_s, lambda r: stages.get(r, -1), clock)
        """What this rank knows of its peers' beats."""
        self.on_failure: Callable[[PPSyncError], None] | None = None
        """Acts on a failure found while no engine call runs (the vLLM
        plugin: log it and end the worker); called once, under the lock."""
        self._lock = threading.Lock()
        self._busy = 0  # engine calls under way (engine_call)
        self._acted = False
        self._first_seen: dict[int, tuple[dist.Work, float]] = {}  # id -> (work, when seen)
        self._wake = threading.Condition()
        self._beat_now = False  # the start-up phase changed: beat at once
        self._poked = False  # poke(): a round at once
        self.first_beat = threading.Event()
        """Set once this rank's first beat was published (or there is no board)."""
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="ppsync-watch", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """No more watching (the path closed); waits up to STOP_S, unless
        called from the watcher itself."""
        with self._wake:
            self._stopped = True
            self._wake.notify_all()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(STOP_S)

    def poke(self) -> None:
        """Run a round now (a frame waits for its copy: the rounds then come
        every HURRY_S until it went)."""
        with self._wake:
            self._poked = True
            self._wake.notify_all()

    def starting(self, what: str | None) -> None:
        """This rank's start-up is at ``what`` (None: done); its peers read
        it at once (the watcher beats now)."""
        self.activity.starting(what)
        with self._wake:
            self._beat_now = True
            self._wake.notify_all()

    # -- what a wait asks (ppsync.core.wire.waits.WaitWatch) -------------------

    def begin(self, what: str) -> int:
        # no wake-up: most waits end within a slice; a long one is seen at
        # the watcher's next round (at most a beat away)
        return self.activity.waiting(what)

    def end(self, token: int) -> None:
        self.activity.waited(token)

    def describe(self, ranks: Sequence[int]) -> str:
        """What the beats say of ``ranks``, and of any rank not alive."""
        view = self.peer_view
        shown = list(ranks) + [r for r in self.others if r not in ranks and not view.alive(r)
                               and view.quiet_s(r) is not None]
        return "; ".join(view.describe(r) for r in shown) or "no peer to describe"

    def failure(self) -> PPSyncError | None:
        return self.watched.failure()

    # -- the engine's calls (an adapter whose engine may stop calling) ---------

    @contextlib.contextmanager
    def engine_call(self) -> Iterator[None]:
        """Around each engine call of an adapter that uses ``on_failure``:
        the watcher acts only while none runs, and never during one."""
        with self._lock:
            self._busy += 1
        try:
            yield
        finally:
            with self._lock:
                self._busy -= 1

    def act_once(self, act: Callable[[], None]) -> None:
        """Run ``act`` (acting on the path's failure) unless the watcher or
        an earlier call already acted: from the engine's thread, once its
        call raised the failure."""
        with self._lock:
            if self._acted:
                return
            self._acted = True
            act()

    # -- the thread -----------------------------------------------------------

    def _run(self) -> None:
        self.platform.enter_thread()  # before any device call: the engine's device
        next_beat = next_look = 0.0
        while True:
            with self._wake:
                if self._stopped:
                    return
                beat_now, self._beat_now = self._beat_now, False
                self._poked = False
            now = self.clock()
            period = BEAT_S
            try:  # one bad round must not end the rank's liveness
                if self.board is not None and (now >= next_beat or beat_now):
                    self.board.beat(self.activity.beat(self.watched.step_count()).encode())
                    next_beat = now + BEAT_S
                self.first_beat.set()
                with native_call():  # queries: the process's exit waits for them
                    pending_s = self._look_at_works(now)
                waiting = self.activity.waiting_now()
                period = LOOK_S if pending_s is not None or waiting else BEAT_S
                depends = waiting or (pending_s is not None and pending_s >= DEPENDS_S)
                if self.board is not None and now >= next_look:
                    next_look = now + period
                    self._read_board(depends)
                self._round()
                hurry = self.watched.hurry()
            except Exception:
                log.exception("ppsync: rank %d: the watcher's round failed", self.me)
                hurry = False
            with self._wake:
                if self._stopped:
                    return
                due = min(next_beat, next_look) if self.board is not None else now + period
                if hurry:
                    due = min(due, now + HURRY_S)
                if not (self._beat_now or self._poked):
                    self._wake.wait(max(0.0, due - self.clock()))

    def _look_at_works(self, now: float) -> float | None:
        """Fail the path for a work that ended badly or outlived the cap;
        how long the oldest pending work has been seen pending (None: none)."""
        ended, well = self.completion.ended, self.completion.ended_well
        seen: dict[int, tuple[dist.Work, float]] = {}
        bad = None
        with self.platform.capture_safe():
            for work in self.watched.outstanding():
                if not ended(work):
                    first = self._first_seen.get(id(work))
                    seen[id(work)] = (work, now) if first is None or first[0] is not work \
                        else first
                elif bad is None and has_future(work) and not well(work):
                    # a work without a future (gloo's send, recv: SGLang's) is
                    # judged by its owner's one wait, never waited here again
                    bad = work
        self._first_seen = seen
        oldest = None if not seen else now - min(t for _, t in seen.values())
        if self.watched.failure() is not None:
            return oldest
        if bad is not None:
            try:  # ended: raises its own error at once
                self.completion.wait(bad, timeout_s=0.0, what=f"rank {self.me}: a transfer",
                                     peer=None)
            except PPSyncError as e:
                self.watched.fail_in_background(e, True)
                return oldest
        if oldest is not None and oldest > self.max_pending_s:
            self.watched.fail_in_background(SyncTimeout(
                f"rank {self.me}: a transfer pending for {oldest:.0f} s since it was seen "
                f"posted: past max_pending_s = {self.max_pending_s:g} (ppsync's cap, before the "
                f"backend's own timeout); {self.describe(self.peers)}"), True)
        return oldest

    def _read_board(self, depends: bool) -> None:
        """Read the peers' beats and the failure count; while the rank
        depends on its peers (``depends``: DEPENDS_S), fail the path for a
        notice or a silent rank."""
        assert self.board is not None
        got = self.board.look(self.others)
        if got is None:
            return
        beats, failed = got
        self.peer_view.update(beats)
        if self.watched.failure() is not None or not depends:
            return  # a path that depends on nothing learns of a failure when it next waits
        if failed:
            self.watched.fail_in_background(
                Relayed(f"rank {self.me}: another rank reported a failure"), False)
            return
        silent = self.peer_view.silent(self.others)
        if silent:
            who = "; ".join(self.peer_view.describe(r) for r in silent)
            self.watched.fail_in_background(SyncTimeout(
                f"rank {self.me}: peer rank(s) {', '.join(map(str, silent))} (global) silent "
                f"past silent_s = {self.peer_view.silent_s:g}: {who}", peer=silent[0]), True)

    def _round(self) -> None:
        """While no engine call runs: the watched object's tick, and acting
        on a failure once (``on_failure``)."""
        with self._lock:
            if self._busy:
                return
            failure = self.watched.failure()
            if failure is None:
                try:
                    self.watched.tick()
                except Exception:  # the watcher goes on; the path's calls report their own
                    log.exception("ppsync: rank %d: the watcher's round failed", self.me)
                return
            if self.on_failure is None or self._acted:
                return
            self._acted = True
            try:
                self.on_failure(failure)
            except Exception:  # acting failed: the engine's next call still raises it
                log.exception("ppsync: acting on %s failed", type(failure).__name__)
