"""Released tensors never alias a frame buffer: buffers are recycled for later
frames, and the engine may keep a released step as long as it likes."""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from ppsync.core import SampledStep
from ppsync.core.path.token_path import TokenPath
from ppsync.core.rules import BatchView
from ppsync.core.wire.groups import token_group
from ppsync.harness.launcher import RankEnv, spawn_ranks
from ppsync.schemas.config import SyncConfig

STEPS = 6


def _view(slot: int) -> BatchView:
    one = np.ones(1, dtype=np.int64)
    return BatchView(1, np.array([slot], dtype=np.int64), one * 9, one, one * 3)


def _rank(env: RankEnv) -> list[list[int]]:
    config = SyncConfig.build(pp_size=2, max_num_reqs=4, num_speculative_steps=2,
                              ring_depth=1, timeout_s=env.timeout_s)
    path = TokenPath(config, token_group(dist.group.WORLD, timeout_s=env.timeout_s))  # type: ignore[arg-type]
    kept = []
    for t in range(STEPS):
        if path.is_last:
            tokens = torch.full((1, 3), 100 + t, dtype=torch.int64)
            ones = torch.ones(1, dtype=torch.int32)
            drafts = torch.full((1, 2), 200 + t, dtype=torch.int64)
            path.publish(_view(t % 4), SampledStep(tokens, ones * 3, ones * 0, drafts))
        else:
            released = path.consume()
            if released is not None:
                kept.append(released)  # held across later consumes
            path.post(_view(t % 4))
    if not path.is_last:
        last = path.consume()
        assert last is not None
        kept.append(last)
    path.close()
    return [[int(r.sampled_tokens[0, 0]), int(r.draft_tokens[0, 0])]  # type: ignore[index]
            for r in kept]


def test_released_one_row_steps_stay_intact_after_buffers_are_reused() -> None:
    receiver, last = spawn_ranks(_rank, 2, timeout_s=30)
    assert last == []
    assert receiver == [[100 + t, 200 + t] for t in range(STEPS)]
