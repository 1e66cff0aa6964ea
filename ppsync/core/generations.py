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

    def bump(self, req_idx: int) -> None:
        """Mark slot ``req_idx`` freed (finish, abort, preemption)."""
        if isinstance(req_idx, bool) or not isinstance(req_idx, (int, np.integer)):
            raise BatchError(f"req_idx = {req_idx!r} must be an int")
        if not 0 <= req_idx < self.max_num_reqs:
            raise BatchError(
                f"req_idx = {req_idx} outside [0, max_num_reqs = {self.max_num_reqs})"
            )
        self._gen_np[req_idx] += 1

    def generation(self, req_idx: int) -> int:
        """Slot ``req_idx``'s current generation (times it was freed)."""
        return int(self._gen_np[req_idx])

    def snapshot(self, idx_mapping_np: np.ndarray) -> np.ndarray:
        """[num_reqs] int64: the current generation of each row's slot."""
        snap: np.ndarray = self._gen_np[idx_mapping_np]
        return snap

    def unchanged(self, idx_mapping_np: np.ndarray, snapshot_np: np.ndarray) -> np.ndarray:
        """[num_reqs] bool: rows whose slot was not freed since ``snapshot``."""
        unchanged: np.ndarray = self._gen_np[idx_mapping_np] == snapshot_np
        return unchanged
