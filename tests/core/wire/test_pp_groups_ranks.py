"""A PP group that is a subgroup of a larger world (tensor x pipeline): the
token path uses group ranks for the broadcast root and global ranks where
torch.distributed wants them."""

from __future__ import annotations

import torch.distributed as dist

from ppsync.core.path.token_path import TokenPath
from ppsync.core.wire.groups import pipeline_groups, token_groups
from ppsync.harness.driver import run_sync_rank, workload_config
from ppsync.harness.launcher import RankEnv, spawn_ranks
from ppsync.schemas.config import SyncConfig
from ppsync.schemas.run_report import RankReport

WORLD, PP = 4, 2


def _rank(env: RankEnv) -> tuple[list[int], RankReport]:
    pp_groups = pipeline_groups(env.world_size, PP)
    pp_group, tok = token_groups(pp_groups, timeout_s=env.timeout_s)
    members = dist.get_process_group_ranks(pp_group)
    config = SyncConfig.build(pp_size=PP, max_num_reqs=8, num_speculative_steps=1,
                              timeout_s=env.timeout_s)
    path = TokenPath(config, tok, board=env.failure_board(tok))
    return members, run_sync_rank(path, workload_config(config, steps=120, seed=3))


def test_pipeline_groups_is_vllm_convention() -> None:
    assert pipeline_groups(4, 2) == [[0, 2], [1, 3]]
    assert pipeline_groups(6, 3) == [[0, 2, 4], [1, 3, 5]]


def test_two_pp_groups_in_one_world_deliver_exactly() -> None:
    results = spawn_ranks(_rank, WORLD, timeout_s=60)
    for rank, (members, report) in enumerate(results):
        assert rank in members
        assert members in pipeline_groups(WORLD, PP)
        # the last member of each PP group samples; the others receive
        assert report.role == ("last" if rank == members[-1] else "receiver")
        assert report.faults == 0, report
        if report.role == "receiver":
            assert report.rows_delivered == report.rows_expected > 0
