"""Rule 3 of docs/design.md: one generation counter per request slot.

A request slot index is reused when its request ends. Bumping the slot's
counter whenever it is freed lets a consumer tell, D steps after a receive was
posted, whether a row still belongs to the request it was posted for.
"""

from __future__ import annotations

import numpy as np

from ppsync.errors import BatchError


class GenerationTable:
    """Generation counter per request slot index in ``[0, max_num_reqs)``."""

    def __init__(self, max_num_reqs: int) -> None:
        self.max_num_reqs = max_num_reqs
        self._gen_np = np.zeros(max_num_reqs, dtype=np.int64)  # [max_num_reqs]
        self._frees = 0  # bumps so far
        self._freed_at = np.zeros(max_num_reqs, dtype=np.int64)  # [max_num_reqs] _frees after

    def bump(self, req_idx: int) -> None:
        """Mark slot ``req_idx`` freed (finish, abort, preemption)."""
        if isinstance(req_idx, bool) or not isinstance(req_idx, (int, np.integer)):
            raise BatchError(f"req_idx = {req_idx!r} must be an int")
        if not 0 <= req_idx < self.max_num_reqs:
            raise BatchError(
                f"req_idx = {req_idx} outside [0, max_num_reqs = {self.max_num_reqs})"
            )
        self._gen_np[req_idx] += 1
        self._frees += 1
        self._freed_at[req_idx] = self._frees

    def mark(self) -> int:
        """A mark of the frees so far (an int, no array read): with
        :meth:`unchanged_since` it tells which rows' slots were freed since,
        at no cost for the usual step in which no slot was freed."""
        return self._frees

    def unchanged_since(self, idx_mapping_np: np.ndarray, mark: int) -> np.ndarray | None:
        """[num_reqs] bool: rows whose slot was not freed since ``mark``; None
        when no slot at all was freed since (every row unchanged)."""
        if self._frees == mark:
            return None
        unchanged: np.ndarray = self._freed_at[idx_mapping_np] <= mark
        return unchanged

    def generation(self, req_idx: int) -> int:
        """Slot ``req_idx``'s current generation (times it was freed)."""
        return int(self._gen_np[req_idx])
