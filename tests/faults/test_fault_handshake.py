"""Start-up is bounded: a rank that never reaches the configuration
handshake (the token group's first use) is named within timeout_s, on
gloo and on the CPU twins of NCCL and XCCL, by the sync path and by the
services (docs/design.md, "When they fail")."""

from __future__ import annotations

import functools
import time

import anyio
import pytest
import torch.distributed as dist
from twin_mode import Mode, in_mode, mode_group

from ppsync.core.path.token_path import TokenPath
from ppsync.core.wire.groups import token_group
from ppsync.errors import PPSyncError
from ppsync.harness.launcher import RankEnv, spawn_ranks
from ppsync.schemas.config import SyncConfig
from ppsync.services.runtime import open_rank

TIMEOUT_S = 2.0
ABSENT = 1  # makes the token group, never the path


async def _open(config: SyncConfig, group: dist.ProcessGroup) -> None:
    async with open_rank(config, group):
        pass


def _rank(mode: Mode, how: str, env: RankEnv) -> tuple[str, int | None, str, float] | None:
    group = mode_group(token_group(dist.group.WORLD, timeout_s=60.0),  # type: ignore[arg-type]
                       mode)
    if env.rank == ABSENT:
        time.sleep(TIMEOUT_S + 4)
        return None
    config = in_mode(SyncConfig.build(pp_size=3, max_num_reqs=8, timeout_s=TIMEOUT_S), mode)
    t0 = time.monotonic()
    try:
        if how == "sync":
            TokenPath(config, group)
        else:
            anyio.run(_open, config, group, backend=how)
    except PPSyncError as e:
        return type(e).__name__, getattr(e, "peer", None), str(e), time.monotonic() - t0
    return "", None, "opened", time.monotonic() - t0


@pytest.mark.parametrize(("mode", "how"), [("gloo", "sync"), ("twin", "sync"),
                                           ("xccl", "asyncio"), ("twin", "trio")])
def test_a_rank_that_never_reaches_the_handshake_is_named(mode: Mode, how: str) -> None:
    results = spawn_ranks(functools.partial(_rank, mode, how), 3, timeout_s=TIMEOUT_S + 20)
    for rank, seen in enumerate(results):
        if rank == ABSENT:
            continue
        assert seen is not None
        kind, peer, message, after_s = seen
        assert kind == "SyncTimeout", seen
        assert peer == ABSENT, seen
        assert f"rank(s) {ABSENT} (global) never reached the configuration handshake" in message
        # from before the path was built (its codec and kernels come first)
        assert TIMEOUT_S * 0.9 <= after_s <= TIMEOUT_S + 3, seen
