"""A step's batch: its view, its checks, and what the token path derives
from it, in one place:

- ``view``: :class:`BatchView`, what every rank knows about a step's rows;
- ``mask``: rule 1, which rows need a sample;
- ``validate``: the full checks, each failure named (``validate_batch``);
- ``facts``: the one-pass checks and per-row facts the token path keeps
  (``batch_facts``; on a failure it runs ``validate_batch`` for the message).

The checks of the sampler's outputs are ppsync.core.rules.checks'.
"""

from ppsync.core.rules.facts import BatchFacts, batch_facts
from ppsync.core.rules.mask import need_sampled_mask
from ppsync.core.rules.validate import (
    COUNT_LIMIT,
    check_view_shapes,
    out_of_range,
    unsigned_max,
    validate_batch,
)
from ppsync.core.rules.view import BatchView, batch_view_of

__all__ = [
    "COUNT_LIMIT",
    "BatchFacts",
    "BatchView",
    "batch_facts",
    "batch_view_of",
    "check_view_shapes",
    "need_sampled_mask",
    "out_of_range",
    "unsigned_max",
    "validate_batch",
]
