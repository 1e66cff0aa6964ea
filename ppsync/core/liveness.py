"""Naming the lost peer: a failure board in a torch.distributed store.

When a rank dies, gloo tells only the ranks directly connected to it (within
~10 ms), and their messages name an address, not a rank; the other ranks just
see silence until their timeout. So every rank that sees a transfer fail
*posts* on the board, and every rank that waits checks the board once per
``slice_s`` (0.25 s): a failure anywhere reaches every survivor within about
that slice (a wait that long is already abnormal; healthy waits take ms),
and the ranks that never posted, after a short grace, are the lost ones.

The store must outlive any rank: the local launcher hosts it in a process of
its own; under torchrun the agent's store does. Without a board, errors still
come typed and bounded, but cannot name the lost peer.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from typing import Any

from torch._C._distributed_c10d import Store  # dist.Store, in a form mypy resolves


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
    ) -> None:
        self.store = store
        self.ranks = list(ranks)
        self.me = me
        self.grace_s = grace_s
        self.slice_s = slice_s
        group_id = "-".join(str(r) for r in self.ranks)
        self._prefix = f"{namespace}/failed/{group_id}"
        self._count = f"{self._prefix}/count"
        self._posted = False

    def _key(self, rank: int) -> str:
        return f"{self._prefix}/{rank}"

    def post(self, kind: str, message: str, **views: dict[str, int]) -> None:
        """Say, once, that this rank saw a failure of type ``kind``. Never
        raises: the store may be gone too."""
        if self._posted:
            return
        self._posted = True
        notice = json.dumps({"rank": self.me, "kind": kind, "message": message, **views})
        try:
            self.store.set(self._key(self.me), notice)
            self.store.add(self._count, 1)
        except Exception:  # a dead store must not mask the real error
            pass

    def notices(self) -> list[dict[str, Any]]:
        """Every notice posted so far (one store round trip per rank)."""
        out = []
        for r in self.posted():
            try:
                out.append(json.loads(self.store.get(self._key(r))))
            except Exception:
                continue
        return out

    def anyone_failed(self) -> bool:
        """Whether any rank of the group has posted (one store round trip)."""
        try:
            return int(self.store.add(self._count, 0)) > 0
        except Exception:
            return False

    def posted(self) -> list[int]:
        try:
            return [r for r in self.ranks if self.store.check([self._key(r)])]
        except Exception:
            return []

    def missing(self) -> list[int]:
        """The other ranks that have not posted (yet)."""
        seen = set(self.posted())
        return [r for r in self.ranks if r not in seen and r != self.me]

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
