"""What each rank of a local run has done so far, in memory the launcher
shares with its ranks: the launcher ends a rank that stops stepping (not a
run that takes long), and a run ended early still reports what was checked.

The launcher makes one :class:`StepBoard` before it forks the ranks; each
rank :func:`claim`\\ s its row, and its step loop :func:`note`\\ s its step
count and its checker's tally after every step (a few stores into shared
memory: no lock, no system call; each value is one aligned int64 word, so
a reader sees each whole, and a rank that is killed or stopped leaves its
last values behind).
"""

from __future__ import annotations

import multiprocessing as mp
import time
from dataclasses import dataclass, field
from typing import Any

FIELDS = ("steps", "transfers", "rows_sent", "rows_expected", "excluded", "rows_delivered",
          "lost", "stale", "duplicated", "corrupt")
"""One row per rank: steps done, then the RankReport fields of the same names."""
_N = len(FIELDS)


class StepBoard:
    """``world_size`` rows of :data:`FIELDS`, shared with forked children."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self._words: Any = mp.get_context("fork").RawArray("q", world_size * _N)

    def steps(self, rank: int) -> int:
        """Steps rank ``rank`` has completed (0: none yet)."""
        return int(self._words[rank * _N])

    def row(self, rank: int) -> dict[str, int]:
        """Rank ``rank``'s last values, by field name."""
        return {f: int(self._words[rank * _N + i]) for i, f in enumerate(FIELDS)}


@dataclass(slots=True)
class StallWatch:
    """The launcher's progress bound: each rank's step count on ``board``
    and when it last changed; a rank is stuck once it completed no step for
    ``stall_s`` (``setup_s`` before its first: joining, making the groups,
    loading the kernels)."""

    board: StepBoard
    stall_s: float
    setup_s: float
    seen: dict[int, tuple[int, float]] = field(default_factory=dict)

    def stuck(self, ranks: list[int]) -> dict[int, str]:
        """Of ``ranks``, those that completed no step for too long: why, in words."""
        now = time.monotonic()
        out = {}
        for r in ranks:
            steps = self.board.steps(r)
            before, since = self.seen.get(r, (-1, now))
            if steps != before:
                self.seen[r] = (steps, now)
                continue
            bound = self.stall_s if steps else self.setup_s
            if now - since > bound:
                what = f"after step {steps}" if steps else "before its first step"
                out[r] = (f"rank {r} completed no step for {bound:.0f} s ({what}): "
                          "ended as stuck")
        return out


_mine: tuple[Any, int] | None = None  # (the board's words, this rank's first index)


def claim(board: StepBoard, rank: int) -> None:
    """This process is rank ``rank`` of ``board``'s run (in the child)."""
    global _mine
    _mine = (board._words, rank * _N)


def claimed() -> bool:
    """Whether this process writes a board row."""
    return _mine is not None


def note(steps: int, transfers: int, rows_sent: int, tally: Any) -> None:
    """This rank's progress after a step (``tally``: its checker's); a no-op
    outside a launched rank."""
    if _mine is None:
        return
    words, at = _mine
    words[at + 1] = transfers
    words[at + 2] = rows_sent
    words[at + 3] = tally.rows_expected
    words[at + 4] = tally.excluded
    words[at + 5] = tally.delivered
    words[at + 6] = tally.lost
    words[at + 7] = tally.stale
    words[at + 8] = tally.duplicated
    words[at + 9] = tally.corrupt
    words[at] = steps  # last: the step count is what the launcher watches
