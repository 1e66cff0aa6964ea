"""The token path's dedicated process group (rule 6 of docs/design.md).

The group has the same ranks as the PP group it serves, so its collectives
never serialize behind the hidden-state send/recv between stages. Groups are
always passed in: nothing here reaches for a global group except where a
caller asks for the default one explicitly.

Two ways to make it:

- :func:`token_group` from one PP group, using
  ``new_group(..., use_local_synchronization=True)``: only the members take
  part, so an object handed a single PP group (the vLLM adapter) can do it.
- :func:`token_groups` from a whole layout (e.g. tensor x pipeline): every
  world rank calls it, and it creates every PP group's token group in one
  order, as a plain ``new_group`` requires.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence

import torch.distributed as dist

from ppsync.errors import ConfigError


def _timeout(timeout_s: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=timeout_s)


def token_group(
    pp_group: dist.ProcessGroup, *, timeout_s: float, backend: str | None = None
) -> dist.ProcessGroup:
    """A new group with ``pp_group``'s ranks; collective over its members only.
    ``backend``: None = the default group's (e.g. "gloo" for host frames in a
    world whose default backend is nccl)."""
    ranks = dist.get_process_group_ranks(pp_group)
    group: dist.ProcessGroup | None = dist.new_group(
        ranks, timeout=_timeout(timeout_s), backend=backend, use_local_synchronization=True
    )
    assert group is not None  # this rank is a member of pp_group
    return group


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


def pipeline_layout(world_size: int, pp_size: int) -> list[list[int]]:
    """PP groups of a tensor x pipeline layout, vLLM's convention: with
    ``tp = world_size // pp_size``, PP group i holds ranks i, i+tp, i+2tp, ..."""
    if pp_size < 1 or world_size % pp_size:
        raise ConfigError(
            f"pp_size = {pp_size} must divide world_size = {world_size} "
            "(world = tensor x pipeline)"
        )
    tp = world_size // pp_size
    return [[i + tp * s for s in range(pp_size)] for i in range(tp)]


def check_layout(layout: Sequence[Sequence[int]], world_size: int) -> None:
    """Every world rank in exactly one PP group, all groups of one size."""
    seen = sorted(r for g in layout for r in g)
    if seen != list(range(world_size)):
        raise ConfigError(
            f"layout {[list(g) for g in layout]} must cover ranks 0..{world_size - 1} once each"
        )
    sizes = {len(g) for g in layout}
    if len(sizes) != 1:
        raise ConfigError(f"layout groups have sizes {sorted(sizes)}; all must be equal")


def token_groups(
    layout: Sequence[Sequence[int]], *, timeout_s: float, backend: str | None = None
) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """Create every PP group of ``layout`` and its token group, in layout
    order, on every world rank; return this rank's (pp_group, token_group).
    ``backend``: the token groups' (None = the default group's; "nccl" for
    the device codec's frames on CUDA).

    Collective over the whole world: every world rank must call it with the
    same layout."""
    check_layout(layout, dist.get_world_size())
    me = dist.get_rank()
    mine: tuple[dist.ProcessGroup, dist.ProcessGroup] | None = None
    for ranks in layout:
        pp = dist.new_group(list(ranks), timeout=_timeout(timeout_s))
        tok = dist.new_group(list(ranks), timeout=_timeout(timeout_s), backend=backend)
        if me in ranks:
            assert pp is not None and tok is not None
            mine = (pp, tok)
    assert mine is not None  # check_layout put every rank in one group
    return mine
