"""How one rank's end of a token group fails: the error every rank raises
for one cause (named through the failure board, ppsync.core.wire.board), the
abort that ends a stream-ordered group's pending transfers, and the notice
of a rank that leaves mid-run."""

from __future__ import annotations

import torch.distributed as dist

from ppsync.core.path.handshake import never_arrived
from ppsync.core.wire.board import FailureBoard
from ppsync.core.wire.completion import Completion
from ppsync.core.wire.teardown import keep_until_exit
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
        self.raised: PPSyncError | None = None
        """What the path raised for its abort (stream-ordered groups); None
        while it has not aborted."""

    def named(self, err: PPSyncError, *, settle: bool, observed: bool) -> PPSyncError:
        """The error to raise for ``err``: the same type on every rank for one
        cause, naming the culprit where the board knows it (see
        ppsync.core.wire.waits.named_failure); ``err`` itself without a board. A
        stream-ordered group is aborted on the first such failure."""
        told = self.raised
        if told is not None and self.board is None:
            named = told  # a wait this path's own abort ended: the error that made it
        else:
            # after this path's abort its other waits end with the abort's
            # cause: that is no observation of a peer, the board's verdict stands
            named = named_failure(err, self.board, rank=self.rank, settle=settle,
                                  observed=observed and told is None)
        if told is None and self.completion.stream_ordered and (
                self.completion.cause is not None or isinstance(named, (SyncTimeout, PeerLost))):
            # stream-ordered: a transfer that will not end would hold the
            # side stream (and NCCL's kernel) forever
            self.abort(named)
            self.raised = named
        return named

    def handshake_error(self, err: SyncTimeout) -> SyncTimeout:
        """The start-up handshake did not complete within timeout_s: the
        error naming the ranks that never reached it (from the board), the
        group aborted where that is how its pending transfer ends (the
        communicator's first use must not spin, nor meet NCCL's watchdog)."""
        err = never_arrived(err, self.board)
        self.abort(err)
        keep_until_exit(self.group)
        return err

    def abort(self, cause: PPSyncError) -> None:
        """Stream-ordered: fail every work of the group with ``cause`` and
        end the backend's pending transfers (returns at once; see
        ppsync.core.wire.completion.base). gloo ends its works at the group's
        timeout: nothing to abort, and a later failure is its own."""
        if self.completion.stream_ordered:
            self.completion.abort(self.group, cause)

    def leave(self, reason: str) -> None:
        """Tell the peers (on the board) that this rank left its token path
        mid-run, e.g. its engine raised: their waits end at their next board
        check, naming this rank, instead of at their timeout."""
        if self.board is not None and not self.board.has_posted:
            self.board.post("Left", reason)
