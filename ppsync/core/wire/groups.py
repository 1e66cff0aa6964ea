"""The token path's dedicated process group (rule 6 of docs/design.md).

The group has the same ranks as the PP group it serves, so its collectives
never serialize behind the hidden-state send/recv between stages. Groups are
always passed in: nothing here reaches for a global group except where a
caller asks for the default one explicitly.

Creating a group is collective over the whole world in torch (``new_group``:
every world rank enters it, groups in one order on every rank); on a world
initialized eagerly on NCCL (``init_process_group(device_id=...)``) a subgroup
is an ``ncclCommSplit`` of the world's communicator, which every world rank
must call, non-members included (docs/design.md §2, rule 6). So token groups
are made the way vLLM makes its own groups: every world rank creates every PP
group's token group, in one order.

- :func:`token_group_among`: this rank's token group, given every PP
  group of the world (the PP groups); every world rank calls it.
- :func:`strided_groups`: those PP groups under vLLM's convention, from the world
  size and one PP group's ranks (what the vLLM adapter is handed).
- :func:`token_groups`: every PP group's token group, and the PP groups.
- :func:`token_group` from one PP group alone: collective over the members
  only (``use_local_synchronization=True``), or over the world when the PP
  group is the world; refused where it would be an NCCL/XCCL split of an
  eagerly initialized world.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence

import torch.distributed as dist

from ppsync.errors import ConfigError


def _timeout(timeout_s: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=timeout_s)


def splits_world(backend: str | None) -> bool:
    """True where a new group with ``backend`` (None: the default group's) is
    made by splitting the world's communicator: the world was initialized
    eagerly (bound to a device) and the group is not gloo-only. Then every
    world rank must take part in creating it (see the module docstring)."""
    world = dist.group.WORLD
    if world is None or getattr(world, "bound_device_id", None) is None:
        return False
    return str(dist.Backend(backend or dist.get_backend())) != "gloo"


def token_group(
    pp_group: dist.ProcessGroup, *, timeout_s: float, backend: str | None = None
) -> dist.ProcessGroup:
    """A new group with ``pp_group``'s ranks, for a caller that knows only its
    own PP group. ``backend``: None = the default group's (e.g. "gloo" for
    host frames in a world whose default backend is nccl).

    When ``pp_group`` is the whole world, every world rank is a member and
    calls it: a plain ``new_group``. Otherwise it is collective over the
    members only (``use_local_synchronization=True``), so the other PP
    groups' ranks need not call it; that is refused with ConfigError where
    the world was initialized eagerly and the group would be an NCCL/XCCL
    split (non-members must call ``ncclCommSplit`` too: members would hang):
    there, every world rank calls :func:`token_group_among`."""
    ranks = dist.get_process_group_ranks(pp_group)
    world_size = dist.get_world_size()
    if len(ranks) == world_size:
        whole: dist.ProcessGroup | None = dist.new_group(
            ranks, timeout=_timeout(timeout_s), backend=backend)
        assert whole is not None  # every rank is a member
        return whole
    if splits_world(backend):
        raise ConfigError(
            f"token_group: PP group {ranks} is {len(ranks)} of {world_size} world ranks and the "
            "world was initialized with device_id (eager NCCL/XCCL), where a subgroup is a "
            "communicator split every world rank must call: call token_group_among("
            "pp_group, pp_groups) on every world rank (pp_groups: every PP group, e.g. "
            "strided_groups(world_size, pp_ranks)), or pass backend='gloo'"
        )
    group: dist.ProcessGroup | None = dist.new_group(
        ranks, timeout=_timeout(timeout_s), backend=backend, use_local_synchronization=True
    )
    assert group is not None  # this rank is a member of pp_group
    return group


def token_group_among(
    pp_group: dist.ProcessGroup, pp_groups: Sequence[Sequence[int]], *, timeout_s: float,
    backend: str | None = None,
) -> dist.ProcessGroup:
    """This rank's token group, made the way vLLM makes its own groups: every
    PP group of ``pp_groups`` gets its token group, in their order, on every
    world rank (a plain ``new_group`` each; a rank outside a group takes part
    in its creation too, as an NCCL split of an eagerly initialized world
    requires). ``pp_group`` must be this rank's group of ``pp_groups``.

    Collective over the whole world: every world rank must call it, with the
    same PP groups, at the same point of its start-up."""
    check_pp_groups(pp_groups, dist.get_world_size())
    ranks = dist.get_process_group_ranks(pp_group)
    if [sorted(g) for g in pp_groups].count(sorted(ranks)) != 1:
        raise ConfigError(f"PP group {ranks} is not one of the PP groups "
                          f"{[list(g) for g in pp_groups]}")
    mine: dist.ProcessGroup | None = None
    for members in pp_groups:
        group = dist.new_group(list(members), timeout=_timeout(timeout_s), backend=backend)
        if sorted(members) == sorted(ranks):
            mine = group
    assert mine is not None  # check_pp_groups and the check above put this rank in one group
    return mine


def strided_groups(world_size: int, pp_ranks: Sequence[int]) -> list[list[int]]:
    """Every PP group of a world laid out as vLLM lays it out, from the world
    size and one PP group's (global) ranks.

    vLLM orders the world as ExternalDP x DP x PP x PCP x TP, the last fastest
    (``initialize_model_parallel``), so a PP group steps through its ranks by
    one stride (PCP x TP) and the groups are those starting at every rank
    whose PP coordinate is 0. ConfigError where ``pp_ranks`` is not evenly
    spaced or the world does not hold whole blocks of pp_size x stride."""
    ranks = sorted(pp_ranks)
    pp = len(ranks)
    if pp == 0 or len(set(ranks)) != pp:
        raise ConfigError(f"pp_ranks = {list(pp_ranks)} must be distinct ranks, at least one")
    stride = ranks[1] - ranks[0] if pp > 1 else 1
    if ranks != [ranks[0] + s * stride for s in range(pp)]:
        raise ConfigError(
            f"pp_ranks = {ranks} are not evenly spaced, as vLLM spaces a PP group "
            "(pass the PP groups explicitly)")
    if world_size % (pp * stride):
        raise ConfigError(
            f"world_size = {world_size} is not a multiple of pp_size x stride = {pp} x "
            f"{stride}, as vLLM's PP groups make it (pass the PP groups explicitly)")
    pp_groups = [[base + s * stride for s in range(pp)]
              for base in range(world_size) if (base // stride) % pp == 0]
    if ranks not in pp_groups:
        raise ConfigError(f"pp_ranks = {ranks} is not one of vLLM's PP groups {pp_groups} "
                          "(pass the PP groups explicitly)")
    return pp_groups


def group_facts(group: dist.ProcessGroup) -> tuple[int, int, list[int], str]:
    """(rank, size, global ranks, backend name) of ``group``, read from the
    group object itself. A group registered with torch.distributed gives its
    global ranks; an unregistered one (a gloo backend made directly, e.g.
    two ranks of one process in ``ppsync.bench.codec_cpu``) numbers its ranks
    0..size-1, which is all the token path needs them for (messages, dumps)."""
    rank, size = group.rank(), group.size()
    try:
        ranks = dist.get_process_group_ranks(group)
        backend = str(dist.get_backend(group))
    except (KeyError, ValueError, RuntimeError):  # what torch raises for an unknown group
        ranks, backend = list(range(size)), str(group.name())
    return rank, size, ranks, backend


def pipeline_groups(world_size: int, pp_size: int) -> list[list[int]]:
    """PP groups of a tensor x pipeline world, vLLM's convention: with
    ``tp = world_size // pp_size``, PP group i holds ranks i, i+tp, i+2tp, ..."""
    if pp_size < 1 or world_size % pp_size:
        raise ConfigError(
            f"pp_size = {pp_size} must divide world_size = {world_size} "
            "(world = tensor x pipeline)"
        )
    tp = world_size // pp_size
    return [[i + tp * s for s in range(pp_size)] for i in range(tp)]


def check_pp_groups(pp_groups: Sequence[Sequence[int]], world_size: int) -> None:
    """Every world rank in exactly one PP group, all groups of one size."""
    seen = sorted(r for g in pp_groups for r in g)
    if seen != list(range(world_size)):
        raise ConfigError(
            f"PP groups {[list(g) for g in pp_groups]} must cover ranks 0..{world_size - 1} "
            "once each"
        )
    sizes = {len(g) for g in pp_groups}
    if len(sizes) != 1:
        raise ConfigError(f"PP groups have sizes {sorted(sizes)}; all must be equal")


def token_groups(
    pp_groups: Sequence[Sequence[int]], *, timeout_s: float, backend: str | None = None
) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """Create every PP group of ``pp_groups`` and its token group, in their
    order, on every world rank; return this rank's (pp_group, token_group).
    ``backend``: the token groups' (None = the default group's; "nccl" for
    the device codec's frames on CUDA).

    Collective over the whole world: every world rank must call it with the
    same PP groups."""
    check_pp_groups(pp_groups, dist.get_world_size())
    me = dist.get_rank()
    mine: tuple[dist.ProcessGroup, dist.ProcessGroup] | None = None
    for ranks in pp_groups:
        pp = dist.new_group(list(ranks), timeout=_timeout(timeout_s))
        tok = dist.new_group(list(ranks), timeout=_timeout(timeout_s), backend=backend)
        if me in ranks:
            assert pp is not None and tok is not None
            mine = (pp, tok)
    assert mine is not None  # check_pp_groups put every rank in one group
    return mine
