"""A rank killed mid-run (SIGKILL): every survivor ends, bounded, with a
PeerLost that names the dead rank, and nothing is left running.

P = 3 ranks run the synthetic workload over a token path with a failure
board (``RankEnv.failure_board``; the parent hosts the store, so it outlives
the kill). At step ``KILL_AT`` the victim records the time and SIGKILLs
itself; the survivors' loops would run far longer, so they stop only on the
error. Each survivor writes what it caught (type, ``peer``, message, when,
threads) to a file in ``tmp_path``: ``spawn_ranks`` raises RankFailed for the
victim and drops the survivors' return values, so the files are what the
parent reads. The victim writes its pid and the kill time first.

Checks, per survivor: the error is PeerLost, ``peer`` is the victim's global
rank and the message names it, it came within ``timeout_s + 5`` s of the kill,
and after it the process has exactly the Python threads it had when the world
was up. Then no rank process is alive and the parent has no child left.
"""

from __future__ import annotations

import functools
import json
import multiprocessing
import os
import re
import signal
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

import anyio
import pytest
import torch.distributed as dist
from fault_tools import (
    pid_alive,
    settled_threads,
    thread_names,
    watchdog,
    write_json,
)
from helpers import engine_step, sync_engine_step
from twin_mode import Mode as CompletionMode
from twin_mode import in_mode, mode_group

from ppsync.core.path.token_path import TokenPath
from ppsync.core.wire.board import FailureBoard
from ppsync.core.wire.groups import token_group
from ppsync.errors import PPSyncError, RankFailed
from ppsync.harness.driver import Framework, StepLoop, workload_config
from ppsync.harness.launcher import RankEnv, spawn_ranks
from ppsync.schemas.config import SyncConfig
from ppsync.services.runtime import open_rank

PP_SIZE = 3
TIMEOUT_S = 6.0  # every wait; a survivor must give up within TIMEOUT_S + 5 s of the kill
KILL_AT = 40  # the victim's step of death: the ring (D = P) is full by then
STEPS = 100_000  # far more than the survivors can run before the error stops them
SEED = 11
CONFIG = SyncConfig.build(
    pp_size=PP_SIZE, max_num_reqs=16, num_speculative_steps=2, timeout_s=TIMEOUT_S
)

Mode = Literal["sync"] | Framework


@dataclass(frozen=True, slots=True)
class Outcome:
    """What one rank saw, as written to ``rank<N>.json``."""

    rank: int
    pid: int
    error: str  # type name of what the loop raised; "" if it finished (it must not)
    peer: int | None  # PeerLost.peer
    message: str
    at: float  # time.monotonic() of the catch; for the victim, of the kill
    steps: int  # the step the loop was in
    threads_before: list[str]  # once the world was up
    threads_after: list[str]  # after the error, once the token path was closed


def _write(out_dir: Path, outcome: Outcome) -> None:
    write_json(out_dir / f"rank{outcome.rank}.json", asdict(outcome))


def _die(out_dir: Path, env: RankEnv, step: int, before: list[str]) -> None:
    _write(out_dir, Outcome(env.rank, os.getpid(), "killed", None, "", time.monotonic(),
                            step, before, before))
    os.kill(os.getpid(), signal.SIGKILL)


def _sync_loop(path: TokenPath, victim: int, out_dir: Path, env: RankEnv,
               before: list[str], progress: list[int]) -> None:
    """The engine loop of ``run_sync_rank``."""
    loop = StepLoop(workload_config(CONFIG, steps=STEPS, seed=SEED), path.is_last, path.rank)
    for t in range(loop.total_steps):
        progress[0] = t
        if env.rank == victim and t == KILL_AT:
            _die(out_dir, env, t, before)
        sync_engine_step(path, loop, t)


async def _async_loop(
    config: SyncConfig, group: dist.ProcessGroup, board: FailureBoard, victim: int,
    out_dir: Path, env: RankEnv, before: list[str], progress: list[int],
) -> None:
    """The engine loop of ``run_async_rank_blocking``."""
    async with open_rank(config, group, board=board) as rank:
        loop = StepLoop(workload_config(CONFIG, steps=STEPS, seed=SEED), rank.is_last,
                        rank.rank)
        for t in range(loop.total_steps):
            progress[0] = t
            if env.rank == victim and t == KILL_AT:
                _die(out_dir, env, t, before)
            await engine_step(rank, loop, t)


def _rank(mode: Mode, victim: int, completion: CompletionMode, out_dir: Path,
          env: RankEnv) -> None:
    watchdog(TIMEOUT_S + 8)
    before = thread_names()
    group = token_group(dist.group.WORLD, timeout_s=TIMEOUT_S)  # type: ignore[arg-type]
    mode_group(group, completion)
    config = in_mode(CONFIG, completion)
    board = env.failure_board(group)
    error: PPSyncError | None = None
    progress = [0]  # the step the loop is in
    try:
        if mode == "sync":
            path = TokenPath(config, group, board=board)
            try:
                _sync_loop(path, victim, out_dir, env, before, progress)
            finally:
                path.close(drain=False)  # what an engine does on an error
        else:
            anyio.run(_async_loop, config, group, board, victim, out_dir, env, before,
                      progress, backend=mode)
    except PPSyncError as e:
        error = e
    caught = time.monotonic()  # CLOCK_MONOTONIC: one clock for every process of the host
    after = settled_threads(before)
    _write(out_dir, Outcome(
        env.rank, os.getpid(), "" if error is None else type(error).__name__,
        getattr(error, "peer", None), str(error or ""), caught, progress[0], before, after,
    ))


class ThreadsLeftBehind(AssertionError):
    """A survivor had more Python threads after the error than before."""


CASES = [
    pytest.param("sync", 0, "gloo", id="sync-kill0"),
    pytest.param("sync", 1, "gloo", id="sync-kill1"),
    pytest.param("sync", 2, "gloo", id="sync-kill2"),  # the last rank: the sender itself dies
    pytest.param("asyncio", 0, "gloo", id="asyncio-kill0"),
    pytest.param("asyncio", 2, "gloo", id="asyncio-kill2"),
    pytest.param("trio", 1, "gloo", id="trio-kill1"),
    pytest.param("trio", 2, "gloo", id="trio-kill2"),
    # the CPU twin of NCCL: the middle rank, and the last
    pytest.param("sync", 1, "twin", id="twin-sync-kill1"),
    pytest.param("asyncio", 1, "twin", id="twin-asyncio-kill1"),
    pytest.param("trio", 2, "twin", id="twin-trio-kill2"),
    # ... with the frames by the host carrier (the default on a GPU)
    pytest.param("sync", 1, "carried", id="carried-sync-kill1"),
    pytest.param("asyncio", 2, "carried", id="carried-asyncio-kill2"),
    # XCCL's semantics (no abort), and NCCL's with an abort that never returns
    pytest.param("sync", 1, "xccl", id="xccl-sync-kill1"),
    pytest.param("trio", 2, "xccl", id="xccl-trio-kill2"),
    pytest.param("asyncio", 1, "hang", id="hang-asyncio-kill1"),
    pytest.param("sync", 2, "hang", id="hang-sync-kill2"),
]

# Observed seconds from the kill to each survivor's error, for the report
# (``pytest -s`` prints them): ~1 s when a receiver dies (the board's slice),
# a few ms when the last rank dies (gloo resets the connections at once).


@pytest.mark.parametrize(("mode", "victim", "completion"), CASES)
def test_survivors_name_the_killed_rank(mode: Mode, victim: int, completion: CompletionMode,
                                        tmp_path: Path) -> None:
    with pytest.raises(RankFailed) as info:
        spawn_ranks(functools.partial(_rank, mode, victim, completion, tmp_path), PP_SIZE,
                    timeout_s=TIMEOUT_S)
    # only the victim failed, and by the signal: every survivor returned normally
    assert list(info.value.errors) == [victim], info.value.errors
    assert info.value.errors[victim] == f"rank {victim} died (exit code -{signal.SIGKILL})"

    outcomes = {
        r: Outcome(**json.loads((tmp_path / f"rank{r}.json").read_text()))
        for r in range(PP_SIZE)
    }
    killed = outcomes[victim]
    assert killed.error == "killed" and killed.steps == KILL_AT, killed
    survivors = [o for r, o in outcomes.items() if r != victim]
    for o in survivors:
        assert o.error == "PeerLost", o
        assert o.peer == victim, o
        # "lost peer rank(s) 2 (global); ...": the message names the victim
        assert re.search(rf"^lost peer rank\(s\) {victim} \(global\)", o.message), o.message
        elapsed = o.at - killed.at
        print(f"{mode} kill {victim}: rank {o.rank} PeerLost {elapsed:.2f} s after the kill")
        # the twins' bound is the one stream-ordered groups promise
        assert 0 <= elapsed <= TIMEOUT_S + (5 if completion == "gloo" else 1), (elapsed, o)
    # no rank process is left, and the parent holds no child
    for o in outcomes.values():
        assert not pid_alive(o.pid), o
    assert multiprocessing.active_children() == []
    # ppsync left no Python thread behind (gloo's own threads are not Python's)
    # but, where the backend's abort never returns, the daemon thread blocked
    # in it (the engine's thread never joins it: the process exits regardless)
    for o in survivors:
        after = [t for t in o.threads_after
                 if not (completion == "hang" and t.startswith("ppsync-abort:"))]
        if completion == "hang":
            assert len(after) == len(o.threads_after) - 1, o.threads_after
        if after != o.threads_before:
            raise ThreadsLeftBehind(f"rank {o.rank}: {o.threads_before} -> {o.threads_after}")
