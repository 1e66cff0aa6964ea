"""The token group is made the way vLLM makes its own groups: every world rank
creates every PP group's token group, in one order (docs/design.md, rule 6).
On an eagerly initialized NCCL world a subgroup is an ``ncclCommSplit`` every
world rank must call; on gloo the same order shows in the groups' names,
which torch numbers by a per-rank count of the groups created in that order."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from ppsync.compat.vllm import PPHandler
from ppsync.core.wire.groups import pipeline_groups, strided_groups, token_group_among
from ppsync.errors import ConfigError
from ppsync.harness.launcher import RankEnv, spawn_ranks

TP, PP = 2, 2
WORLD = TP * PP
CPU = torch.device("cpu")


def _vllm_pp_groups(world: int, dp: int, pp: int, pcp: int, tp: int) -> list[list[int]]:
    """vLLM's PP groups: the world as ExternalDP x DP x PP x PCP x TP (TP
    fastest), each group the ranks that differ only in their PP coordinate."""
    ranks = torch.arange(world).reshape(-1, dp, pp, pcp, tp)
    return [g.tolist() for g in ranks.transpose(2, 4).reshape(-1, pp).unbind(0)]


@pytest.mark.parametrize(("dp", "pp", "pcp", "tp"),
                         [(1, 2, 1, 2), (1, 4, 1, 1), (2, 2, 1, 2), (1, 2, 2, 2),
                          (2, 3, 1, 1), (1, 1, 1, 4)])
def test_strided_groups_is_vllms_pp_groups(dp: int, pp: int, pcp: int, tp: int) -> None:
    world = dp * pp * pcp * tp
    groups = _vllm_pp_groups(world, dp, pp, pcp, tp)
    for ranks in groups:
        assert sorted(strided_groups(world, ranks)) == sorted(groups)
    assert strided_groups(world, groups[0]) == strided_groups(world, groups[-1])


def test_strided_groups_names_a_group_outside_vllms_pp_groups() -> None:
    with pytest.raises(ConfigError, match=r"pp_ranks = \[0, 1, 3\] are not evenly spaced"):
        strided_groups(4, [0, 1, 3])
    with pytest.raises(ConfigError, match="world_size = 6 is not a multiple of"):
        strided_groups(6, [0, 2])
    with pytest.raises(ConfigError, match=r"pp_ranks = \[2, 4\] is not one of vLLM.s PP groups"):
        strided_groups(8, [2, 4])


def _groups_rank(env: RankEnv) -> tuple[list[int], list[str], float]:
    """vLLM's start-up on every rank: its PP groups, every one on every rank;
    then ppsync's handler on this rank's PP group, and a plain
    token_group_among. Returns (the handler's token group's ranks, the
    names of the two token groups made here, the sum of the global ranks of
    the token group's members, all-reduced over it)."""
    pp_groups = pipeline_groups(env.world_size, PP)
    mine = None
    for ranks in pp_groups:  # what vLLM's init_model_parallel_group does
        group = dist.new_group(ranks)
        if env.rank in ranks:
            mine = group
    assert mine is not None
    handler = PPHandler(8, 0, CPU, group=mine, timeout_s=env.timeout_s)
    tok = handler.token_path.group
    again = token_group_among(mine, pp_groups, timeout_s=env.timeout_s)
    with pytest.raises(ConfigError, match=r"PP group \[\d, \d\] is not one of the PP groups"):
        token_group_among(mine, [[0, 1], [2, 3]], timeout_s=env.timeout_s)  # before any
    total = torch.tensor([float(env.rank)])
    dist.all_reduce(total, group=tok)
    handler.close()
    return (dist.get_process_group_ranks(tok), [tok.group_name, again.group_name],
            float(total.item()))


def test_every_rank_creates_every_token_group_in_one_order() -> None:
    results = spawn_ranks(_groups_rank, WORLD, timeout_s=60)
    pp_groups = pipeline_groups(WORLD, PP)
    bases: set[int] = set()
    for rank, (members, names, total) in enumerate(results):
        index = next(i for i, g in enumerate(pp_groups) if rank in g)
        assert members == pp_groups[index]
        assert total == sum(pp_groups[index])
        # torch names a group made on every rank by how many such groups this
        # rank made before it: one name scheme, the same count on every rank,
        # and each PP group at its own place in the order. A group made by
        # its members only gets a hash of its ranks instead.
        assert all(n.isdigit() for n in names), f"rank {rank}: made by members only: {names}"
        first, second = (int(n) for n in names)
        assert second - first == len(pp_groups)
        bases.add(first - index)
    assert len(bases) == 1, f"token groups made in different orders: {results}"
