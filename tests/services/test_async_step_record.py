"""The services' step record (ppsync.schemas.StepRecord): kept as the values
the core checked and validated when read, so it costs the hot path nothing;
what it says must still be each step as the rank saw it."""

from __future__ import annotations

import anyio
import pytest
import torch.distributed as dist

from ppsync.bench.common import fixed_step
from ppsync.core import SampledStep
from ppsync.core.wire.groups import token_group
from ppsync.harness.launcher import RankEnv, spawn_ranks
from ppsync.schemas.config import SyncConfig
from ppsync.schemas.records import StepRecord
from ppsync.services.runtime import open_rank

ROWS, K = 6, 2
CONFIG = SyncConfig.build(pp_size=2, max_num_reqs=ROWS, num_speculative_steps=K,
                          timeout_s=20.0)


def _rank(env: RankEnv) -> list[dict[str, object] | None]:
    group = token_group(dist.group.WORLD, timeout_s=CONFIG.timeout_s)  # type: ignore[arg-type]
    step = fixed_step(ROWS, K)
    seen: list[dict[str, object] | None] = []

    async def main() -> None:
        async with open_rank(CONFIG, group) as rank:
            record = rank.service.last_record
            seen.append(None if record is None else record.model_dump())
            for i in range(3):
                drafts = step.drafts if i % 2 else None
                if rank.is_last:
                    await rank.publish(step.view, SampledStep(
                        step.tokens, step.num_sampled, step.num_rejected, drafts))
                else:
                    await rank.take()
                    await rank.post(step.view)
                record = rank.service.last_record
                assert isinstance(record, StepRecord)
                seen.append(record.model_dump())
            if not rank.is_last:
                for _ in range(CONFIG.depth):
                    await rank.take()

    anyio.run(main)
    return seen


@pytest.mark.timeout(120)
def test_the_record_of_each_step_is_what_the_rank_saw() -> None:
    receiver, last = spawn_ranks(_rank, 2, timeout_s=60.0)
    for seen, drafts in ((receiver, (False, False, False)), (last, (False, True, False))):
        assert seen[0] is None  # nothing published or posted yet
        for i, record in enumerate(seen[1:]):
            assert record == {"step": i, "num_reqs": ROWS, "num_needed": ROWS,
                              "sample_width": K + 1, "num_drafts": K,
                              "has_drafts": drafts[i], "idx_digest": 0}, (i, record)
