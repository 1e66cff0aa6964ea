"""How one rank's end of a token group fails: the error every rank raises
for one cause (named through the failure board, ppsync.core.wire.board), the
abort that ends a stream-ordered group's pending transfers, and the notice
of a rank that leaves mid-run.

A failure may be found by the engine's thread (in a wait, a frame's check)
or by the rank's watcher thread (ppsync.core.wire.rank_watch: a silent or
lost peer, another rank's notice). Both go through :meth:`PathFailures.named`
under one lock: the first names it (posts, aborts), and the path's failure
(:attr:`PathFailures.final`) is then that error for both threads."""

from __future__ import annotations

import threading

import torch.distributed as dist

from ppsync.core.path.handshake import never_arrived
from ppsync.core.wire.board import FailureBoard
from ppsync.core.wire.completion import Completion
from ppsync.core.wire.heartbeat import Peers
from ppsync.core.wire.teardown import keep_until_exit, mark_aborted
from ppsync.core.wire.waits import named_failure
from ppsync.errors import PeerLost, PPSyncError, SyncTimeout


class PathFailures:
    """The failures of one token path over ``group``: what it raises, what
    it aborts, what it tells its peers."""

    def __init__(self, group: dist.ProcessGroup, *, rank: int, board: FailureBoard | None,
                 completion: Completion) -> None:
        self.group = group
        self.rank = rank
        self.board = board
        self.completion = completion
        self.peers: Peers | None = None
        """What the heartbeats say of the group's ranks (set once the path's
        watcher exists): a silent rank is named before an alive one."""
        self.final: PPSyncError | None = None
        """The path's failure: nothing of the group is used again. Set by a
        failure that breaks the group (a lost or silent peer, a wait's
        timeout, an abort) or that was posted on the board (every rank
        raises it); None while the path works (a desync without a board
        leaves it working)."""
        self.told = False
        """The engine was handed :attr:`final` once (later calls say the path
        failed earlier)."""
        self._lock = threading.Lock()

    @property
    def raised(self) -> PPSyncError | None:
        """What the path aborted its group for (stream-ordered), or None."""
        return self.final if self.completion.cause is not None else None

    def named(self, err: PPSyncError, *, settle: bool, observed: bool) -> PPSyncError:
        """The error to raise for ``err``: the same type on every rank for one
        cause, naming the culprit where the board knows it (see
        ppsync.core.wire.waits.named_failure); ``err`` itself without a
        board. The path's failure, once it has one, whoever found it. A
        stream-ordered group is aborted on the first failure that breaks it."""
        with self._lock:
            if self.final is not None:
                return self.final
            aborted = self.completion.cause is not None
            named = named_failure(err, self.board, rank=self.rank, settle=settle,
                                  observed=observed and not aborted, peers=self.peers)
            breaks = isinstance(named, (SyncTimeout, PeerLost))
            if breaks or aborted or self.board is not None:
                self.final = named
            if self.completion.stream_ordered and (aborted or breaks):
                # stream-ordered: a transfer that will not end would hold the
                # side stream (and NCCL's kernel) forever
                self.abort(named)
            return named

    def post(self, err: PPSyncError, *, observed: bool) -> None:
        """Post this rank's notice for ``err`` only (an event loop then waits
        for the others in its own way before :meth:`named`)."""
        with self._lock:
            if self.final is None:
                named_failure(err, self.board, rank=self.rank, settle=False,
                              observed=observed, peers=self.peers)

    def handshake_error(self, err: SyncTimeout) -> SyncTimeout:
        """The start-up handshake did not complete within timeout_s: the
        error naming the ranks that never reached it (from the board), the
        group aborted where that is how its pending transfer ends (the
        communicator's first use must not spin, nor meet NCCL's watchdog)."""
        err = never_arrived(err, self.board)
        with self._lock:
            self.final = self.final or err
        self.abort(err)
        keep_until_exit(self.group)
        return err

    def abort(self, cause: PPSyncError) -> None:
        """Stream-ordered: fail every work of the group with ``cause`` and
        end the backend's pending transfers (returns at once; see
        ppsync.core.wire.completion.semantics). gloo ends its works at the group's
        timeout: nothing to abort, and a later failure is its own. Either
        way the group is marked: no new token path is built on it."""
        mark_aborted(self.group, cause)
        if self.completion.stream_ordered:
            self.completion.abort(self.group, cause)

    def leave(self, reason: str) -> None:
        """Tell the peers (on the board) that this rank left its token path
        mid-run, e.g. its engine raised: their waits end at their next board
        check, naming this rank, instead of at their timeout."""
        if self.board is not None and not self.board.has_posted:
            self.board.post("Left", reason)
