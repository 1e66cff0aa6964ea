"""The failure board's scope and what survivors are told, on real gloo ranks:

- notices are scoped to one run: a notice an earlier run left in the same
  store (a restart under torchrun's agent store, an engine rebuilding its
  token path) does not fail a fresh, healthy run (it did, at frame 0, with
  PeerLost naming a healthy rank);
- without a board, a killed rank is named by nobody rather than by the wrong
  rank (rank 1 was told "peer 2" when rank 0 died), and every survivor gets
  the same error type;
- a rank whose engine raises and leaves ``open_rank`` while its process stays
  alive posts that it left: its peers end with PeerLost naming it within a
  few board slices, not at their timeout;
- gloo's own timeout on the token group comes after the path's deadline by
  more than a board read: when it passes, gloo closes every connection of the
  group, and a survivor that had not yet read the first notice took that for
  a lost rank where the fault was a silent one (``dump show`` said "lost" for
  a SIGSTOPped rank, 1 run in 6 on a loaded machine).
"""

from __future__ import annotations

import functools
import json
import os
import signal
import time
from pathlib import Path

import anyio
import pytest
import torch
import torch.distributed as dist
from fault_tools import watchdog, write_json
from helpers import engine_step, sync_engine_step

from ppsync.core.path.token_path import TokenPath
from ppsync.core.wire.board import FailureBoard
from ppsync.core.wire.completion.semantics import GLOO_TIMEOUT_MARGIN_S
from ppsync.core.wire.groups import token_group
from ppsync.errors import PPSyncError, RankFailed
from ppsync.harness.driver import StepLoop, run_sync_rank, workload_config
from ppsync.harness.launcher import RankEnv, spawn_ranks
from ppsync.schemas.config import SyncConfig
from ppsync.services.runtime import open_rank

PP_SIZE = 3
TIMEOUT_S = 20.0  # far above what a named failure takes


def _config(timeout_s: float = TIMEOUT_S) -> SyncConfig:
    return SyncConfig.build(pp_size=PP_SIZE, max_num_reqs=16, num_speculative_steps=1,
                            timeout_s=timeout_s)


def _group() -> dist.ProcessGroup:
    return token_group(dist.group.WORLD, timeout_s=TIMEOUT_S)  # type: ignore[arg-type]


# -- notices of an earlier run ---------------------------------------------------------


def _two_runs_rank(env: RankEnv) -> tuple[int, int, int]:
    """Run 1 fails (every rank posts a notice, as after a fault), run 2 must
    not see them: it runs the workload to the end over the same store."""
    group = _group()
    first = TokenPath(_config(), group, board=env.failure_board(group))
    assert first.board is not None
    first.board.post("PeerLost", f"run 1: rank {env.rank} saw a failure")
    first.close(drain=False)
    group2 = _group()  # an engine rebuilding its token path: same ranks, same store
    path = TokenPath(_config(), group2, board=env.failure_board(group2))
    assert path.run_id != first.run_id
    report = run_sync_rank(path, workload_config(_config(), steps=120, seed=3))
    return report.lost + report.stale + report.duplicated + report.corrupt, \
        report.rows_delivered, report.transfers


def test_an_earlier_runs_notices_do_not_fail_a_fresh_run() -> None:
    results = spawn_ranks(_two_runs_rank, PP_SIZE, timeout_s=TIMEOUT_S)
    for faults, delivered, transfers in results[:-1]:
        assert faults == 0 and delivered > 0 and transfers > 0, results
    assert results[-1][2] > 0, results


# -- no board: a kill is named by nobody, not by the wrong rank ---------------------------

KILL_AT = 30


def _no_board_rank(out_dir: Path, env: RankEnv) -> None:
    watchdog(TIMEOUT_S + 8)
    path = TokenPath(_config(5.0), _group(), board=None)
    loop = StepLoop(workload_config(path.config, steps=10_000, seed=2), path.is_last, path.rank)
    caught: dict[str, object] = {"error": ""}
    try:
        for t in range(loop.total_steps):
            if env.rank == 0 and t == KILL_AT:
                os.kill(os.getpid(), signal.SIGKILL)
            sync_engine_step(path, loop, t)
    except PPSyncError as e:
        caught = {"error": type(e).__name__, "peer": getattr(e, "peer", -1), "message": str(e)}
    finally:
        path.close(drain=False)
    write_json(out_dir / f"rank{env.rank}.json", caught)


def test_without_a_board_a_killed_rank_is_named_by_nobody_not_the_wrong_rank(
    tmp_path: Path,
) -> None:
    with pytest.raises(RankFailed) as info:
        spawn_ranks(functools.partial(_no_board_rank, tmp_path), PP_SIZE, timeout_s=TIMEOUT_S)
    assert list(info.value.errors) == [0], info.value.errors
    caught = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (1, 2)]
    for c in caught:
        assert c["error"] == "PeerLost", caught  # one type on every survivor
        assert c["peer"] is None, caught  # rank 2 (alive) was named before


# -- a rank that leaves open_rank and stays alive ----------------------------------------

LEAVE_AT = 20
STAY_ALIVE_S = 8.0  # the leaver's process lives on, far past when its peers must know


async def _leaving_engine(config: SyncConfig, group: dist.ProcessGroup, leaver: int,
                          board: FailureBoard) -> tuple[str, int | None, float]:
    loop = StepLoop(workload_config(config, steps=10_000, seed=4),
                    dist.get_rank(group) == config.pp_size - 1, dist.get_rank(group))
    start = time.monotonic()
    try:
        async with open_rank(config, group, board=board) as rank:
            for t in range(loop.total_steps):
                if dist.get_rank() == leaver and t == LEAVE_AT:
                    raise ValueError("the engine's own bug")
                await engine_step(rank, loop, t)
    except PPSyncError as e:
        return type(e).__name__, getattr(e, "peer", None), time.monotonic() - start
    except ValueError:
        await anyio.sleep(STAY_ALIVE_S)  # alive, but out of its token path
        return "ValueError", None, 0.0
    return "", None, 0.0


def _leaving_rank(leaver: int, framework: str, env: RankEnv) -> tuple[str, int | None, float]:
    group = _group()
    return anyio.run(_leaving_engine, _config(), group, leaver, env.failure_board(group),
                     backend=framework)


@pytest.mark.parametrize(("leaver", "framework"), [(0, "asyncio"), (2, "trio")])
def test_a_rank_leaving_by_an_exception_is_named_by_its_peers_at_once(
    leaver: int, framework: str
) -> None:
    results = spawn_ranks(functools.partial(_leaving_rank, leaver, framework), PP_SIZE,
                          timeout_s=TIMEOUT_S)
    for rank, (error, peer, after_s) in enumerate(results):
        if rank == leaver:
            assert error == "ValueError", results
            continue
        assert (error, peer) == ("PeerLost", leaver), results
        # a few board slices after the leave, not TIMEOUT_S
        assert after_s < STAY_ALIVE_S, results


# -- gloo's timeout after ppsync's own cap ------------------------------------------------


def _gloo_timeout_rank(env: RankEnv) -> tuple[float, float]:
    group = _group()
    config = _config(3.0).model_copy(update={"max_pending_s": 40.0})
    path = TokenPath(config, group, board=env.failure_board(group))
    own = group._get_backend(torch.device("cpu")).options._timeout.total_seconds()
    path.close()
    return own, config.max_pending_s


def test_gloos_own_timeout_comes_after_ppsyncs_cap_on_a_pending_transfer() -> None:
    """gloo counts its timeout from the post, as a healthy receive waits for
    a whole pipeline: its clock is set past ppsync's own cap on a pending
    transfer (max_pending_s, which the watcher enforces), never at a wait's
    bound (timeout_s)."""
    for own, cap in spawn_ranks(_gloo_timeout_rank, PP_SIZE, timeout_s=TIMEOUT_S):
        assert own == cap + GLOO_TIMEOUT_MARGIN_S
        assert own > 3.0 + GLOO_TIMEOUT_MARGIN_S
