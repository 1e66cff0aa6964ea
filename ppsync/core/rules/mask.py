"""Rule 1 of docs/design.md: which rows of a step produce a sample."""

from __future__ import annotations

import numpy as np

from ppsync.core.rules.view import BatchView


def need_sampled_mask(view: BatchView) -> np.ndarray:
    """[num_reqs] bool: True where the row produces a sample this step.

    A row samples iff ``num_computed + num_scheduled >= prefill_len`` (a
    non-final prefill chunk samples nothing). With ``max_seq_len``, a row still
    in prefill whose one sampled token reaches the cap
    (``prefill_len + 1 >= max_seq_len``) is excluded: no later step needs it.
    Decode rows are never dropped for the cap; dropping them would freeze the
    earlier stages' view of the request.
    """
    # int64 arithmetic: narrow or mixed integer dtypes must neither wrap
    # (int8 100 + 100) nor promote to float (uint64 + int64)
    computed = view.num_computed_tokens_np.astype(np.int64, copy=False)
    prefill = view.prefill_len_np.astype(np.int64, copy=False)
    scheduled = view.num_scheduled_tokens_np.astype(np.int64, copy=False)
    need: np.ndarray = (computed + scheduled) >= prefill
    if view.max_seq_len_np is not None:
        in_prefill = view.is_prefilling_np if view.is_prefilling_np is not None else (
            computed < prefill
        )
        capped = in_prefill & (prefill + 1 >= view.max_seq_len_np.astype(np.int64, copy=False))
        need &= ~capped
    return need
