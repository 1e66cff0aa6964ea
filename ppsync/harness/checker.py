"""Checks each released step against the synthetic workload, exactly.

For every row of step s, released at step s + D: it is *expected* when it
needed a sample and its request was not freed in between, and *excluded* when
it needed a sample but its request slot was freed in between (the last rank
sent it; the receiver must drop it). A kept row that
was not expected is *stale*; an expected row not kept is *lost*; a kept,
expected row whose tokens, counts, drafts or request slot differ is *corrupt*;
a row for a (request, position) delivered before is *duplicated*.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from ppsync.core.codec.released import ReleasedStep
from ppsync.harness.synthetic_workload import ScheduledStep, Workload


@dataclass(slots=True)
class Tally:
    rows_expected: int = 0
    excluded: int = 0
    delivered: int = 0
    lost: int = 0
    stale: int = 0
    duplicated: int = 0
    corrupt: int = 0


@dataclass(slots=True)
class Checker:
    """One receiver's running tally of delivered rows."""

    workload: Workload
    tally: Tally = field(default_factory=Tally)
    _delivered_upto: dict[int, int] = field(default_factory=dict)  # req_id -> next position

    def expected_rows(self, rec: ScheduledStep, now: int) -> np.ndarray:
        """[num_reqs] bool: rows of ``rec`` that must be handed out at ``now``."""
        freed = self.workload.freed_at
        alive = np.array(
            [not rec.step < freed.get(int(r), -1) < now for r in rec.req_ids_np], dtype=bool
        )
        expected: np.ndarray = rec.need_np & alive if rec.num_reqs else rec.need_np
        return expected

    def check(
        self,
        now: int,
        released: ReleasedStep | None,
        draft_table: torch.Tensor | None = None,  # [max_num_reqs, K]
    ) -> None:
        """Check what the consume at step ``now`` released (step now - D)."""
        for req_id in self.workload.retired:
            self._delivered_upto.pop(req_id, None)
        rec = self.workload.history.get(now - self.workload.depth)
        t = self.tally
        if rec is None:
            if released is not None:
                t.stale += released.num_kept
            return
        expected = self.expected_rows(rec, now)
        t.rows_expected += int(expected.sum())
        t.excluded += int((rec.need_np & ~expected).sum())
        if released is None:
            t.lost += int(expected.sum())
            return
        if released.num_reqs != rec.num_reqs or released.seq != rec.seq:
            t.corrupt += released.num_kept
            t.lost += int(expected.sum())
            return
        idx = released.idx_mapping.numpy()
        kept = idx != -1
        t.stale += int((kept & ~expected).sum())
        t.lost += int((expected & ~kept).sum())
        both = kept & expected
        good = (
            both
            & (idx == rec.view.idx_mapping_np)
            & (released.sampled_tokens.numpy() == rec.tokens_np).all(axis=1)
            & (released.num_sampled.numpy() == rec.num_sampled_np)
            & (released.num_rejected.numpy() == rec.num_rejected_np)
        )
        if rec.drafts_np is not None:
            if released.draft_tokens is None:
                good &= False
            else:
                good &= (released.draft_tokens.numpy() == rec.drafts_np).all(axis=1)
                if draft_table is not None and both.any():
                    in_table = draft_table.numpy()[rec.view.idx_mapping_np[both]]
                    good[both] &= (in_table == rec.drafts_np[both]).all(axis=1)
        t.corrupt += int((both & ~good).sum())
        upto = self._delivered_upto
        for row in np.flatnonzero(good):
            req, pos = int(rec.req_ids_np[row]), int(rec.positions_np[row])
            if pos < upto.get(req, -1):
                t.duplicated += 1
            else:
                t.delivered += 1
                upto[req] = pos + int(rec.num_sampled_np[row])
