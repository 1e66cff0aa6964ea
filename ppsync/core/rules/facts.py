"""One pass over a step's batch view: the checks of ppsync.core.rules, the
need mask of rule 1 (ppsync.core.rules.mask) and the frame's per-row facts, in one
int64 copy the token path keeps.

A numpy call costs about the same whatever its size at these row counts
(docs/measured.md), so the step's own CPU is the count of calls: the view's four arrays go into
one block, one reduction range-checks every count (any negative reads as
>= 2**63 unsigned), one bincount checks for distinct slots, and the mask and
slot_need words are computed in the same block. When a check fails,
validate_batch runs to raise its error naming the field, the row and the
value: every rule and message is validate_batch's.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ppsync.core.rules.mask import need_sampled_mask
from ppsync.core.rules.validate import COUNT_LIMIT, check_view_shapes, validate_batch
from ppsync.core.rules.view import BatchView

_U64 = np.dtype(np.uint64)


@dataclass(slots=True)  # read-only by convention: frozen costs the hot path (docs/measured.md)
class BatchFacts:
    """What the token path derives from one checked batch view, in one fresh
    ``block`` [3, num_reqs] int64 that the path may keep (a copy: the engine
    may refill its arrays): row 0 idx_mapping, row 1 slot_need (``2 * idx +
    need``, the frame's column), row 2 num_computed_tokens."""

    block: np.ndarray
    need: np.ndarray  # [num_reqs] bool: rows that produce a sample (rule 1)
    needed: int  # need.sum()
    digest: int = 0
    """The row facts' digest (the frame's idx_digest; see
    NumpyFrames.facts_digest), where a step has a frame: set by the host
    kernels (ppsync.core.codec.cpu_kernels)."""

    @property
    def idx(self) -> np.ndarray:
        return self.block[0]  # type: ignore[no-any-return]

    @property
    def slot_need(self) -> np.ndarray:
        return self.block[1]  # type: ignore[no-any-return]

    @property
    def computed(self) -> np.ndarray:
        return self.block[2]  # type: ignore[no-any-return]

    @property
    def row_facts(self) -> np.ndarray:
        """[2, num_reqs]: slot_need then num_computed_tokens, the frame's last
        two columns (contiguous: one dot digests them)."""
        return self.block[1:]


def batch_facts(view: BatchView, max_num_reqs: int) -> BatchFacts:
    """:func:`~ppsync.core.rules.validate_batch`,
    :func:`~ppsync.core.rules.mask.need_sampled_mask` and the slot_need words, in
    one pass (see the module's text). A view with the optional max_seq_len /
    is_prefilling arrays takes the two functions as they are."""
    check_view_shapes(view, max_num_reqs)
    n = view.num_reqs
    block = np.empty((4, n), dtype=np.int64)
    block[0] = view.idx_mapping_np  # narrow or unsigned dtypes: exact, or negative
    if view.max_seq_len_np is not None or view.is_prefilling_np is not None:
        validate_batch(view, max_num_reqs)
        need = need_sampled_mask(view)
        block[2] = view.num_computed_tokens_np
    else:
        block[1] = view.num_scheduled_tokens_np
        block[2] = view.num_computed_tokens_np
        block[3] = view.prefill_len_np
        if n:
            u = block.view(_U64)  # a negative entry reads as >= 2**63
            idx_u, counts_u = u[0], u[1:].reshape(-1)
            # a[a.argmax()]: numpy's leanest max here (see batch._max)
            if (idx_u[idx_u.argmax()] >= max_num_reqs
                    or counts_u[counts_u.argmax()] >= COUNT_LIMIT
                    or (n > 1 and _seen_twice(block[0], max_num_reqs))):
                validate_batch(view, max_num_reqs)  # raises, naming the field and row
        need = np.add(block[1], block[2]) >= block[3]  # counts < 2**62: no wrap
    slot_need = block[1]
    np.multiply(block[0], 2, out=slot_need)
    slot_need += need
    return BatchFacts(block[:3], need, int(np.count_nonzero(need)))


def _seen_twice(idx: np.ndarray, max_num_reqs: int) -> bool:
    """Whether some slot index occurs twice in ``idx`` (all in [0, max_num_reqs))."""
    seen = np.bincount(idx, minlength=max_num_reqs)
    return bool(seen[seen.argmax()] > 1)
