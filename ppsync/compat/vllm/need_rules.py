"""Which rows need a sample, as each vLLM release decides it, expressed as the
batch view a handler hands the token path.

Rule 1 of docs/design.md is what every release shares: a row produces a
sample iff ``num_computed + num_scheduled >= prefill_len``. The releases
differ in which producing rows they then drop (vLLM's
``compute_need_sampled_mask`` in ``vllm/v1/worker/gpu/pp_utils.py``):

- 0.23-0.29 (:func:`any_row_cap_view`): every row with
  ``max(num_computed, prefill_len) + 1 >= max_seq_len``, decode rows too;
  ``max_seq_len_np`` must be set (vLLM sets it on every PP step);
- 0.30 (:func:`uncapped_view`): none;
- 0.31 on, and the 0.34 CPU runner (:func:`final_prefill_cap_view`): when
  ``max_seq_len_np`` is set, a row with ``is_prefilling_np`` and
  ``prefill_len + 1 >= max_seq_len``: the core's rule as it is.

Each function returns a view whose mask, by the core's rule, is the
release's: only the optional ``max_seq_len_np`` / ``is_prefilling_np`` are
changed, so the rows' slots, counts and frame facts stay the engine's, and
every rank, building its view with the same function, takes the same
decision.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ppsync.core.rules import BatchView, batch_view_of, validate_batch
from ppsync.errors import BatchError


def final_prefill_cap_view(input_batch: object, max_num_reqs: int) -> BatchView:
    """vLLM 0.31 on: the core's rule 1 as it is (the cap drops a final
    prefill chunk only, and only when ``max_seq_len_np`` is set)."""
    return batch_view_of(input_batch)


def uncapped_view(input_batch: object, max_num_reqs: int) -> BatchView:
    """vLLM 0.30: every row that produces a sample needs it; the cap is not
    read."""
    view = batch_view_of(input_batch)
    return dataclasses.replace(view, max_seq_len_np=None, is_prefilling_np=None)


def any_row_cap_view(input_batch: object, max_num_reqs: int) -> BatchView:
    """vLLM 0.23-0.29: a producing row is dropped when
    ``max(num_computed, prefill_len) + 1 >= max_seq_len``, decode rows too.

    As a view: every row marked in prefill, and the cap lowered by the
    tokens a row has computed past its prompt, ``max(num_computed -
    prefill_len, 0)`` (at least 0), so that the core's ``prefill_len + 1 >=
    cap`` holds exactly where the release's rule does. BatchError when
    ``max_seq_len_np`` is missing (these releases assert it is set)."""
    view = batch_view_of(input_batch)
    if view.max_seq_len_np is None:
        raise BatchError(
            "input_batch.max_seq_len_np is None, but vLLM 0.23-0.29's need rule reads it on "
            "every step (max(num_computed, prefill_len) + 1 < max_seq_len; their model "
            "runner sets it whenever PP is on)")
    validate_batch(view, max_num_reqs)  # the arithmetic below reads the arrays
    computed = view.num_computed_tokens_np.astype(np.int64)  # [num_reqs]
    prefill = view.prefill_len_np.astype(np.int64)  # [num_reqs]
    past_prompt = np.maximum(computed - prefill, 0)  # [num_reqs]
    cap = np.maximum(view.max_seq_len_np.astype(np.int64) - past_prompt, 0)  # [num_reqs]
    return dataclasses.replace(view, max_seq_len_np=cap,
                               is_prefilling_np=np.ones(view.num_reqs, dtype=bool))
