"""How a token path's waits end and what it raises when they fail.

A wait is bounded by ``timeout_s``; with a failure board it runs in slices
of ``board.slice_s`` so that a failure any rank posted ends it within about
a slice. The error raised is the board's verdict (ppsync.core.liveness): the
same type on every rank for one cause, naming the culprit where known.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch.distributed as dist

from ppsync.core.liveness import FailureBoard, kind_of, verdict
from ppsync.core.transport import wait_work
from ppsync.errors import DesyncError, PeerLost, PPSyncError, SyncTimeout

Failed = Callable[[PPSyncError, bool], PPSyncError]
"""(error, observed) -> the error to raise; see :func:`named_failure`."""


def wait_bounded(work: dist.Work, what: str, *, timeout_s: float,
                 board: FailureBoard | None, failed: Failed) -> None:
    """Wait for ``work`` at most ``timeout_s``; a failure (its own, a
    timeout, or one another rank posted) raises ``failed(error, observed)``."""
    if board is None:
        try:
            wait_work(work, timeout_s=timeout_s, what=what, peer=None)
        except PPSyncError as e:
            raise failed(e, True) from e
        return
    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        try:
            wait_work(work, timeout_s=max(0.001, min(left, board.slice_s)), what=what,
                      peer=None)
            return
        except SyncTimeout as e:
            if left <= board.slice_s:
                raise failed(SyncTimeout(f"{what}: no completion within "
                                         f"timeout_s = {timeout_s}"), True) from e
            if board.anyone_failed():
                raise failed(PeerLost(f"{what}: another rank reported a failure"),
                             False) from e
        except PeerLost as e:
            raise failed(e, True) from e


def named_failure(err: PPSyncError, board: FailureBoard | None, *, rank: int, settle: bool,
                  observed: bool) -> PPSyncError:
    """The error to raise for ``err``: the board's verdict after posting this
    rank's notice; ``err`` itself without a board. ``settle``: first wait (up
    to the board's grace) for the survivors to post; an event loop passes
    False after waiting in its own way. ``observed``: False when this rank
    only read of a failure on the board (it then posts what the board says,
    so every rank posts the same cause)."""
    if board is None:
        return err
    mine = err if observed else verdict(err, board.notices(), [], rank=rank, observed=False)
    views = ({"expected": mine.expected, "received": mine.received}
             if isinstance(mine, DesyncError) else {})
    board.post(kind_of(mine), str(mine), **views)
    lost = board.lost() if settle else board.missing()
    return verdict(err, board.notices(), lost, rank=rank, observed=observed)
