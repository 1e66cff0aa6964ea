"""Small builders the tests share (pytest and mypy find this module through
``pythonpath`` / ``mypy_path`` = tests)."""

from __future__ import annotations

import numpy as np

from ppsync.core.path.token_path import TokenPath
from ppsync.core.rules import BatchView
from ppsync.harness.driver import StepLoop, outputs
from ppsync.services.runtime import Rank


def decode_view(idx: list[int]) -> BatchView:
    """A step of decode rows at request slots ``idx``, all needing a sample."""
    n = len(idx)
    return BatchView(
        num_reqs=n,
        idx_mapping_np=np.array(idx, dtype=np.int64),
        num_computed_tokens_np=np.full(n, 10, dtype=np.int64),
        num_scheduled_tokens_np=np.ones(n, dtype=np.int64),
        prefill_len_np=np.full(n, 5, dtype=np.int64),
    )


async def engine_step(rank: Rank, loop: StepLoop, t: int) -> None:
    """Step ``t`` of the workload through the services, in the engine order:
    take (checked), free, schedule, then publish or post."""
    if not rank.is_last:
        loop.released(t, await rank.take(loop.table))
    step = loop.schedule(t, rank.path)
    if rank.is_last:
        await rank.publish(step.view, outputs(step))
    else:
        await rank.post(step.view)


def sync_engine_step(path: TokenPath, loop: StepLoop, t: int) -> None:
    """Step ``t`` of the workload through the synchronous token path, in the
    engine order: consume (checked), free, schedule, then publish or post."""
    if not path.is_last:
        loop.released(t, path.consume(loop.table))
    step = loop.schedule(t, path)
    if path.is_last:
        path.publish(step.view, outputs(step))
    else:
        path.post(step.view)
