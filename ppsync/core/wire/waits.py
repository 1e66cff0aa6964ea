"""How a token path waits, and what it raises when a wait fails.

A wait is bounded by ``timeout_s``; with a failure board it runs in slices
of ``board.slice_s`` (:func:`board_slices`, shared by the synchronous waits
here and the event loop's in ppsync.services.awaiting) so that a failure
any rank posted ends it within about a slice. The error raised is the
board's verdict (ppsync.core.wire.board): the same type on every rank for one
cause, naming the culprit where known.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist

from ppsync.core.wire.board import FailureBoard, kind_of, verdict
from ppsync.core.wire.completion import Completion
from ppsync.core.wire.transport import TransportClock
from ppsync.errors import DesyncError, PeerLost, PPSyncError, SyncTimeout

Failed = Callable[[PPSyncError, bool], PPSyncError]
"""(error, observed) -> the error to raise; see :func:`named_failure`."""


class Relayed(PeerLost):
    """A wait ended because another rank posted a failure on the board: this
    rank saw nothing itself, so the board's notices decide the error."""


def board_slices(what: str, *, timeout_s: float, board: FailureBoard | None,
                 now: Callable[[], float] = time.monotonic) -> Iterator[float]:
    """The lengths of the slices of a wait bounded by ``timeout_s`` (one
    slice without a board). Between slices: SyncTimeout once the deadline
    passed, :class:`Relayed` once another rank posted a failure."""
    deadline = now() + timeout_s
    step = timeout_s if board is None else board.slice_s
    while True:
        left = deadline - now()
        if left <= 0:
            raise SyncTimeout(f"{what}: no completion within timeout_s = {timeout_s}")
        yield max(0.001, min(left, step))
        if board is not None and deadline > now() and board.anyone_failed():
            raise Relayed(f"{what}: another rank reported a failure")


def wait_on_board(work: dist.Work, what: str, *, timeout_s: float,
                 board: FailureBoard | None, failed: Failed, completion: Completion) -> None:
    """Wait for ``work`` at most ``timeout_s`` (as ``completion`` judges its
    end); a failure (its own, a timeout, or one another rank posted) raises
    ``failed(error, observed)``."""
    try:
        if board is None:
            completion.wait(work, timeout_s=timeout_s, what=what, peer=None)
            return
        for slice_s in board_slices(what, timeout_s=timeout_s, board=board):
            try:
                completion.wait(work, timeout_s=slice_s, what=what, peer=None)
                return
            except SyncTimeout:
                continue
    except Relayed as e:
        raise failed(PeerLost(str(e)), False) from e
    except PPSyncError as e:
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


class Waits:
    """One token path's waits: bounded, board-sliced, timed into ``clock``
    when one is set (a benchmark's), each failure turned into the path's
    error by ``failed``; a transfer's end as ``completion`` judges it."""

    def __init__(self, rank: int, timeout_s: float, board: FailureBoard | None,
                 failed: Failed, completion: Completion) -> None:
        self.completion = completion
        self.rank = rank
        self.timeout_s = timeout_s
        self.board = board
        self.failed = failed
        self.clock: TransportClock | None = None
        """When set, collects the CPU time of real waits."""

    def wait(self, work: dist.Work, what: str) -> None:
        """Wait at most timeout_s (see :func:`wait_on_board`)."""
        if self.clock is None or self.completion.ended(work):
            self._wait(work, what)
            return
        t0 = time.thread_time_ns()
        try:
            self._wait(work, what)
        finally:
            self.clock.wait_ns += time.thread_time_ns() - t0

    def _wait(self, work: dist.Work, what: str) -> None:
        wait_on_board(work, f"rank {self.rank}: {what}", timeout_s=self.timeout_s,
                     board=self.board, failed=self.failed, completion=self.completion)

    def for_receive(self, work: dist.Work, seq: int) -> None:
        """:meth:`wait` for frame ``seq``'s receive, unless it already ended well."""
        if not self.completion.ended_well(work):
            self.wait(work, f"receive of frame {seq}")


class InFlight:
    """Transfers issued and not yet known complete, oldest first, with the
    buffers they fill or read: at most ``depth`` are left pending."""

    def __init__(self, depth: int) -> None:
        self.depth = depth
        self._works: deque[tuple[torch.Tensor, dist.Work]] = deque()

    def __len__(self) -> int:
        return len(self._works)

    def add(self, buf: torch.Tensor, work: dist.Work) -> None:
        self._works.append((buf, work))

    def before_issue(self) -> list[dist.Work]:
        """The works :meth:`prune` would wait on: the oldest beyond ``depth``."""
        excess = len(self._works) - self.depth
        return [w for _, w in list(self._works)[: max(0, excess)]]

    def prune(self, waits: Waits, done: Callable[[torch.Tensor, dist.Work], None]) -> None:
        """Drop completed works (``done(buf, work)`` for each); wait for the
        oldest while more than ``depth`` are held."""
        works, ends = self._works, waits.completion
        while works:
            buf, work = works[0]
            if not ends.ended_well(work):
                if len(works) <= self.depth and not ends.ended(work):
                    break
                waits.wait(work, "earlier transfer")  # waits, or raises its failure
            works.popleft()
            done(buf, work)

    def drain(self, waits: Waits) -> None:
        while self._works:
            _, work = self._works.popleft()
            waits.wait(work, "draining transfer")

    def abandoned(self, completion: Completion) -> bool:
        """Whether a work is still pending."""
        return any(not completion.ended(w) for _, w in self._works)

    def clear(self) -> None:
        self._works.clear()
