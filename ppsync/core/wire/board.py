"""Naming the culprit of a failure: a failure board in a torch.distributed store.

When a rank dies, gloo tells only the ranks directly connected to it (within
~10 ms), and their messages name an address, not a rank; the other ranks just
see silence until their timeout. So every rank that sees a failure *posts* a
notice on the board, and every rank that waits checks the board once per
``slice_s`` (0.25 s): a failure anywhere reaches every survivor within about
that slice (a wait that long is already abnormal; healthy waits take ms), and
the ranks that never posted, after a short grace, are the lost ones.

Notices are scoped to one run: the token path binds its board to the run id
its ranks agreed at the start-up handshake, so a notice left in the same
store by an earlier run (a restart under torchrun's agent store, an engine
that rebuilds its token path) is never read as this run's.

The store should outlive any rank: the local launcher hosts it in a process of
its own; under torchrun the agent's store does. Without a board given, the
token path uses its group's own store (:meth:`FailureBoard.of_group`), which
dies with the rank hosting it under a plain env:// rendezvous: then the
errors stay typed and bounded but name only what the rank saw itself.

Every store call is bounded (``op_timeout_s``): a store whose host is stopped
(SIGSTOP) answers nothing, and a blocking call would outlast every deadline.
"""

from __future__ import annotations

import json
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch.distributed as dist
from torch._C._distributed_c10d import Store  # dist.Store, in a form mypy resolves

from ppsync.core.wire.heartbeat import Peers
from ppsync.core.wire.teardown import native_call
from ppsync.errors import DesyncError, PeerLost, PPSyncError, SyncTimeout

T = TypeVar("T")

KINDS = ("DesyncError", "Left", "PeerLost", "SyncTimeout")
"""What a notice says happened, strongest cause first: a desync (another view
of the step), a rank that left its token path (its engine raised), a lost
connection, a silence."""


class _StoreWorker:
    """One daemon thread that makes a board's store calls in turn, so that
    each call can be bounded (a store whose host is stopped never answers)
    without a thread per call. A call that does not return leaves the
    worker stuck there: the board then stops asking (``_silent``). The
    thread ends when told to rest with nothing queued (the token path
    closed), and starts again at the next call."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._running = False
        self._thread: threading.Thread | None = None
        self._pid = os.getpid()

    def ask(self, call: Callable[[], T], default: T, timeout_s: float) -> tuple[T, bool]:
        """``call()`` on the worker: (its result, True), or (``default``,
        True) if it raised, or (``default``, False) if it did not return
        within ``timeout_s``."""
        box: list[T] = [default]
        done = threading.Event()
        for_main = threading.current_thread() is threading.main_thread()

        def job() -> None:
            try:
                with native_call(for_main=for_main):  # a store call: the exit waits for it
                    box[0] = call()
            except Exception:  # a dead store: the caller gets the default
                pass
            finally:
                done.set()

        with self._lock:
            if self._pid != os.getpid():  # a forked child: its parent's thread is not here
                self._pid, self._running = os.getpid(), False
                self._jobs = queue.SimpleQueue()
            self._jobs.put(job)
            if not self._running:
                self._running = True
                self._thread = threading.Thread(target=self._run, args=(self._jobs,),
                                                name="ppsync-board", daemon=True)
                self._thread.start()
        answered = done.wait(timeout_s)
        return box[0], answered

    def rest(self, wait_s: float) -> None:
        """Let the thread end once it has run what was queued; wait up to
        ``wait_s`` for it."""
        with self._lock:
            thread = self._thread if self._running else None
            if thread is not None:
                self._jobs.put(None)
        if thread is not None and thread is not threading.current_thread():
            thread.join(wait_s)

    def _run(self, jobs: queue.SimpleQueue[Callable[[], None] | None]) -> None:
        while True:
            job = jobs.get()
            if job is not None:
                job()
                continue
            with self._lock:
                if jobs.empty():
                    self._running = False
                    return


class FailureBoard:
    """Failure notices of one group's ranks (``ranks``: global ranks)."""

    def __init__(
        self,
        store: Store,
        *,
        ranks: Sequence[int],
        me: int,
        grace_s: float = 2.0,
        slice_s: float = 0.25,
        namespace: str = "ppsync",
        op_timeout_s: float = 1.0,
    ) -> None:
        self.store = store
        self.ranks = list(ranks)
        self.me = me
        self.grace_s = grace_s
        self.slice_s = slice_s
        self.op_timeout_s = op_timeout_s
        self._namespace = namespace
        self._posted = False
        self._silent = False  # the store once did not answer: it is not asked again
        self._worker = _StoreWorker()
        self._beating: set[int] = set()  # ranks whose beat key exists
        self.bind_run(0)

    @classmethod
    def of_group(cls, group: dist.ProcessGroup) -> FailureBoard | None:
        """A board in ``group``'s own store (None when it has none)."""
        try:
            store = group.get_group_store()
        except RuntimeError:
            return None
        return cls(store, ranks=dist.get_process_group_ranks(group), me=dist.get_rank())

    def bind_run(self, run_id: int) -> None:
        """Read and write only this run's notices from now on."""
        group_id = "-".join(str(r) for r in self.ranks)
        self._prefix = f"{self._namespace}/run-{run_id:x}/failed/{group_id}"
        self._count = f"{self._prefix}/count"

    def _key(self, rank: int) -> str:
        return f"{self._prefix}/{rank}"

    def _ask(self, call: Callable[[], T], default: T) -> T:
        """``call()`` on the store, bounded by ``op_timeout_s``; ``default``
        when it fails, and from then on at once if it did not answer (a
        stopped or cut-off store host would cost a timeout per call)."""
        if self._silent:
            return default
        result, answered = self._worker.ask(call, default, self.op_timeout_s)
        self._silent = not answered
        return result

    def rest(self) -> None:
        """No call is expected for a while (its token path closed): the
        board's thread ends; the next call starts it again."""
        self._worker.rest(self.op_timeout_s)

    @property
    def answers(self) -> bool:
        """False once the store did not answer a call in time (it is not
        asked again: nothing on this board can be told or read)."""
        return not self._silent

    # -- heartbeats (ppsync.core.wire.heartbeat) -------------------------------

    def _beat_key(self, rank: int) -> str:
        group_id = "-".join(str(r) for r in self.ranks)
        return f"{self._namespace}/beat/{group_id}/{rank}"

    def beat(self, text: str) -> None:
        """Publish this rank's heartbeat (one store call)."""
        self._ask(lambda: self.store.set(self._beat_key(self.me), text), None)

    def look(self, ranks: Sequence[int]) -> tuple[dict[int, str], bool] | None:
        """(the beats of ``ranks`` that exist, whether another rank posted a
        failure), in one bounded call on the worker; None when the store
        does not answer. A key is read only once it exists (a read of a
        missing key would wait for it). This rank's own notice is not
        another's: its write runs on this worker before any later read, so
        a rank that just posted never reads its own failure as a relayed one."""
        def read() -> tuple[dict[int, str], bool]:
            for r in ranks:
                if r not in self._beating and self.store.check([self._beat_key(r)]):
                    self._beating.add(r)
            known = [r for r in ranks if r in self._beating]
            values = self.store.multi_get([self._beat_key(r) for r in known]) if known else []
            failed = int(self.store.add(self._count, 0)) > int(self._posted)
            return {r: bytes(v).decode() for r, v in zip(known, values, strict=True)}, failed

        return self._ask(read, None)

    def arrive(self, step: str) -> None:
        """This rank reached start-up ``step`` (each rank takes it once), so
        that :meth:`absent` can name the ranks that never did."""
        self._ask(lambda: self.store.set(self._arrival(step, self.me), "1"), None)

    def absent(self, step: str) -> list[int]:
        """The ranks that have not reached ``step``; [] when the store cannot say."""
        def check() -> list[int]:
            return [r for r in self.ranks if not self.store.check([self._arrival(step, r)])]

        return self._ask(check, [])

    def _arrival(self, step: str, rank: int) -> str:
        group_id = "-".join(str(r) for r in self.ranks)
        return f"{self._namespace}/arrived/{step}/{group_id}/{rank}"

    @property
    def has_posted(self) -> bool:
        """Whether this rank posted a notice already."""
        return self._posted

    def post(self, kind: str, message: str, **views: dict[str, int]) -> None:
        """Say, once, that this rank saw a failure of ``kind`` (one of KINDS).
        Never raises, never blocks past ``op_timeout_s``: the store may be gone
        or stopped too."""
        if self._posted:
            return
        self._posted = True
        notice = json.dumps({"rank": self.me, "kind": kind, "message": message, **views})

        def write() -> None:
            self.store.set(self._key(self.me), notice)
            self.store.add(self._count, 1)

        self._ask(write, None)

    def notices(self) -> list[dict[str, Any]]:
        """Every notice posted so far, in rank order."""
        keys = [self._key(r) for r in self.posted() or []]

        def read() -> list[dict[str, Any]]:
            return [json.loads(self.store.get(k)) for k in keys]

        return self._ask(read, [])

    def anyone_failed(self) -> bool:
        """Whether any rank of the group has posted (one store round trip)."""
        return self._ask(lambda: int(self.store.add(self._count, 0)) > 0, False)

    def posted(self) -> list[int] | None:
        """The ranks that posted, in rank order; None when the store does not
        answer (then nobody can be named)."""
        def check() -> list[int] | None:
            return [r for r in self.ranks if self.store.check([self._key(r)])]

        return self._ask(check, None)

    def missing(self) -> list[int]:
        """The other ranks that have not posted (yet); [] when unknown."""
        posted = self.posted()
        if posted is None:
            return []
        return [r for r in self.ranks if r not in posted and r != self.me]

    def lost(self) -> list[int]:
        """The ranks that have not posted once every survivor had the chance:
        waits until all but one posted, at most ``grace_s``. (An event loop
        waits with its own sleep, then calls :meth:`missing`.)"""
        deadline = time.monotonic() + self.grace_s
        while True:
            missing = self.missing()
            if len(missing) <= 1 or time.monotonic() >= deadline:
                return missing
            time.sleep(0.05)


class Relayed(PeerLost):
    """A rank learned of a failure from another rank's notice on the board:
    it saw nothing itself, so the board's notices decide the error."""


def kind_of(err: PPSyncError) -> str:
    """The notice kind (one of KINDS) that ``err`` reports."""
    if isinstance(err, DesyncError):
        return "DesyncError"
    if isinstance(err, SyncTimeout):
        return "SyncTimeout"
    return "PeerLost"


def verdict(
    own: PPSyncError, notices: list[dict[str, Any]], lost: list[int], *, rank: int,
    observed: bool = True, peers: Peers | None = None,
) -> PPSyncError:
    """The one error every rank raises for one cause, from the board's
    notices: a desync if any rank saw one; else a rank that left its token
    path, named; else PeerLost if any rank (or this one, when ``observed``)
    saw a connection fail, else SyncTimeout; both naming the first of ``lost``
    (the ranks that never posted) as ``peer``, or nobody when none is known.
    ``own`` is what this rank saw (not ``observed``: it only read the board).
    ``peers``: what the heartbeats say of the ranks (ppsync.core.wire.heartbeat):
    the silent ones are named first, and a rank that never posted but is
    alive is named as alive and making no progress, never as silent."""
    if isinstance(own, DesyncError) and observed:
        return own
    for n in notices:
        if n["kind"] == "DesyncError":
            return DesyncError(f"rank {rank}: rank {n['rank']} reported: {n['message']}",
                               expected=n.get("expected", {}), received=n.get("received", {}))
    for n in notices:
        if n["kind"] == "Left":
            return PeerLost(f"rank {n['rank']} (global) left its token path ({n['message']}); "
                            f"first seen here as {kind_of(own)}: {own}", peer=n["rank"])
    if peers is not None:  # silent first, then not beating, then alive
        silent = peers.silent(lost)
        lost = sorted(lost, key=lambda r: (r not in silent, peers.alive(r)))
    peer = lost[0] if lost else None
    names = ", ".join(str(r) for r in lost)
    connection = any(n["kind"] == "PeerLost" for n in notices) or (
        observed and isinstance(own, PeerLost))
    if connection:
        if peer is None:
            return own if isinstance(own, PeerLost) and observed else PeerLost(str(own))
        return PeerLost(f"lost peer rank(s) {names} (global); first seen here as "
                        f"{kind_of(own)}: {own}", peer=peer)
    if peer is None:
        return own if isinstance(own, SyncTimeout) and observed else SyncTimeout(str(own))
    if peers is not None and peers.alive(peer):
        # it beats: alive, in its engine or a wait of its own, and no progress
        return SyncTimeout(f"no progress from peer rank(s) {names} (global), alive but not "
                           f"reporting a failure ({peers.describe(peer)}); {own}", peer=peer)
    # nobody saw a connection fail: the unposted ranks are silent, maybe stuck
    told = f" ({peers.describe(peer)})" if peers is not None else ""
    return SyncTimeout(f"silent peer rank(s) {names} (global){told}, no failure reported by "
                       f"any rank; {own}", peer=peer)
