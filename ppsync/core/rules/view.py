"""The batch view of one step: what every rank knows about its rows.

The scheduler is replicated, so every rank holds the same view; everything
the token path decides (which rows need a sample, whether the step has a
transfer at all) is derived from it, which is what keeps collectives matched.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ppsync.errors import BatchError

IntArray = np.ndarray


@dataclass(frozen=True, slots=True)
class BatchView:
    """One step's rows. Arrays are numpy, one entry per row."""

    num_reqs: int
    idx_mapping_np: IntArray  # [num_reqs] int: request slot index of each row
    num_computed_tokens_np: IntArray  # [num_reqs] int
    num_scheduled_tokens_np: IntArray  # [num_reqs] int
    prefill_len_np: IntArray  # [num_reqs] int
    max_seq_len_np: IntArray | None = None  # [num_reqs] int, optional cap
    is_prefilling_np: IntArray | None = None  # [num_reqs] bool, optional


_REQUIRED = ("idx_mapping_np", "num_computed_tokens_np", "prefill_len_np")


def batch_view_of(input_batch: object) -> BatchView:
    """Read a vLLM-style ``input_batch`` (attribute names as in the PPHandler
    interface) into a :class:`BatchView`, without copying arrays."""
    missing = [
        a
        for a in ("num_reqs", *_REQUIRED, "num_scheduled_tokens")
        if not hasattr(input_batch, a)
    ]
    if missing:
        raise BatchError(
            f"input_batch of type {type(input_batch).__name__} lacks {', '.join(missing)}"
        )

    def get(name: str) -> Any:
        # getattr, not __getattribute__: hasattr above also sees __getattr__ attributes
        return getattr(input_batch, name)

    return BatchView(
        num_reqs=get("num_reqs"),
        idx_mapping_np=get("idx_mapping_np"),
        num_computed_tokens_np=get("num_computed_tokens_np"),
        num_scheduled_tokens_np=get("num_scheduled_tokens"),
        prefill_len_np=get("prefill_len_np"),
        max_seq_len_np=getattr(input_batch, "max_seq_len_np", None),
        is_prefilling_np=getattr(input_batch, "is_prefilling_np", None),
    )
