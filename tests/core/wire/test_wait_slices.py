"""A wait in slices (ppsync.core.wire.waits.bounded_wait) when a slice's
timeout and the transfer's end cross: a transfer that ended well just after
its slice timed out is done, not failed (a SIGSTOP test once saw a receiver
report "no completion within timeout_s = 0.25", the slice's length, for a
frame that had arrived as the slice ended)."""

from __future__ import annotations

from typing import cast

import pytest
import torch.distributed as dist

from ppsync.core.wire.completion import Completion
from ppsync.core.wire.waits import bounded_wait
from ppsync.errors import SyncTimeout


class Crossing:
    """A work's end as a stand-in completion reports it: each slice's wait
    times out, and the work is seen ended (well or not) after ``slices`` of them."""

    def __init__(self, slices: int, well: bool) -> None:
        self.left, self.well, self.waits = slices, well, 0

    def wait(self, work: object, *, timeout_s: float, what: str, peer: int | None) -> None:
        self.waits += 1
        self.left -= 1
        raise SyncTimeout(f"{what}: no completion within timeout_s = {timeout_s}")

    def ended(self, work: object) -> bool:
        return self.left <= 0 and self.waits > 0

    def ended_well(self, work: object) -> bool:
        return self.ended(work) and self.well


def _wait(completion: Crossing) -> None:
    bounded_wait(cast(dist.Work, object()), "a receive", timeout_s=30.0,
                 completion=cast(Completion, completion), watch=None, peers=[1])


def test_a_transfer_that_ends_well_as_its_slice_times_out_is_done() -> None:
    crossing = Crossing(slices=2, well=True)
    _wait(crossing)  # returns: no error
    assert crossing.waits == 2


def test_a_transfer_that_ends_badly_raises_its_own_error() -> None:
    with pytest.raises(SyncTimeout, match=r"no completion within timeout_s = 0\.25"):
        _wait(Crossing(slices=1, well=False))
