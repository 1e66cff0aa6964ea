"""Slow is not dead (docs/design.md): a healthy engine, slow or stuck, is
told apart from a stopped one, on gloo and on the twins of NCCL and XCCL,
sync and asyncio, P 2, 3 and 4. Every case ran on real gloo ranks with a
failure board hosted by the launcher (it outlives every rank).

- slow: the last rank's steps take 3 x ``silent_s`` for a stretch, so a
  receive waits for a whole pipeline (post to arrival: D slow steps, past
  ``timeout_s``) while no single wait does: the run completes exactly. (With
  bounds counted from the post, the receivers were failed.)
- stopped: at P 4, with the last rank's steps slower than ``silent_s``, it
  is SIGSTOPped: every receiver names it silent within ``silent_s`` + 1 s of
  the stop (a bound on a wait would have named it only at ``timeout_s``).
- stuck: the last rank alive but making no progress (its engine hangs in a
  step): the waiting receiver ends at ``timeout_s`` from its wait's start,
  naming it as alive and saying what it was doing, never as silent.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import signal
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

import anyio
import pytest
import torch.distributed as dist
from fault_tools import watchdog, write_json
from helpers import engine_step, sync_engine_step
from twin_mode import Mode, check_engine_stream, in_mode, mode_group

from ppsync.core.path.token_path import TokenPath
from ppsync.core.wire.board import FailureBoard
from ppsync.core.wire.groups import token_group
from ppsync.errors import PPSyncError, RankFailed
from ppsync.harness.driver import StepLoop, workload_config
from ppsync.harness.launcher import RankEnv, spawn_ranks
from ppsync.schemas.config import SyncConfig
from ppsync.services.runtime import open_rank

SILENT_S = 2.0
STEP_S = 3 * SILENT_S  # a slow step of the last rank
SEED = 3
Run = Literal["sync", "asyncio"]


def _config(pp_size: int, timeout_s: float, mode: Mode) -> SyncConfig:
    return in_mode(SyncConfig.build(pp_size=pp_size, max_num_reqs=16, num_speculative_steps=1,
                                    timeout_s=timeout_s, silent_s=SILENT_S), mode)


def _group(mode: Mode) -> dist.ProcessGroup:
    return mode_group(token_group(dist.group.WORLD, timeout_s=60.0),  # type: ignore[arg-type]
                      mode)


Pause = dict[int, float]  # step -> seconds the last rank spends in its engine before it


def _run_loop(config: SyncConfig, group: dist.ProcessGroup, board: FailureBoard, run: Run,
              steps: int, pauses: Pause, on_step: object = None) -> StepLoop:
    """The workload for ``steps`` steps; the last rank sleeps ``pauses[t]``
    in its engine before step t. Returns the loop (its checker's tally)."""
    is_last = dist.get_rank(group) == config.pp_size - 1
    loop = StepLoop(workload_config(config, steps=steps, seed=SEED), is_last,
                    dist.get_rank(group))

    def pause(t: int) -> None:
        if callable(on_step):
            on_step(t)
        if is_last and t in pauses:
            time.sleep(pauses[t])

    if run == "sync":
        path = TokenPath(config, group, board=board)
        try:
            for t in range(loop.total_steps):
                pause(t)
                sync_engine_step(path, loop, t)
        finally:
            path.close(drain=True)
        return loop

    async def main() -> None:
        async with open_rank(config, group, board=board) as rank:
            for t in range(loop.total_steps):
                pause(t)
                await engine_step(rank, loop, t)

    anyio.run(main, backend=run)
    return loop


# -- slow ---------------------------------------------------------------------------

SLOW_STEPS = 12
SLOW_AT = (5, 6, 7)  # consecutive slow steps: a receive's post to arrival passes timeout_s
SLOW_TIMEOUT_S = STEP_S + 2.5  # above one step's wait, below a pipeline's latency


def _slow_rank(pp_size: int, mode: Mode, run: Run, env: RankEnv) -> tuple[int, ...]:
    watchdog(120)
    group = _group(mode)
    config = _config(pp_size, SLOW_TIMEOUT_S, mode)
    loop = _run_loop(config, group, env.failure_board(group), run, SLOW_STEPS,
                     dict.fromkeys(SLOW_AT, STEP_S))
    check_engine_stream(mode)
    tl = loop.checker.tally
    return tl.lost, tl.stale, tl.duplicated, tl.corrupt, tl.delivered


SLOW_CASES = [
    pytest.param(2, "gloo", "sync", id="p2-gloo-sync"),
    pytest.param(3, "twin", "asyncio", id="p3-twin-asyncio"),
    pytest.param(3, "xccl", "sync", id="p3-xccl-sync"),
    pytest.param(3, "carried", "trio", id="p3-carried-trio"),
]


@pytest.mark.timeout(180)
@pytest.mark.parametrize(("pp_size", "mode", "run"), SLOW_CASES)
def test_a_slow_last_rank_past_timeout_s_completes_exactly(pp_size: int, mode: Mode,
                                                            run: Run) -> None:
    assert (len(SLOW_AT) - 1) * STEP_S > SLOW_TIMEOUT_S > STEP_S  # the premise
    results = spawn_ranks(functools.partial(_slow_rank, pp_size, mode, run), pp_size,
                          timeout_s=150)
    for rank, (lost, stale, dup, corrupt, delivered) in enumerate(results[:-1]):
        assert (lost, stale, dup, corrupt) == (0, 0, 0, 0), (rank, results)
        assert delivered > 0, (rank, results)


# -- stopped --------------------------------------------------------------------------

STOP_P = 4
STOP_AT = 6
STOP_STEP_S = SILENT_S + 1.0  # the last rank's steps: slower than silent_s
STOP_TIMEOUT_S = 30.0  # far above: only the heartbeat can name the stop in time


@dataclass(frozen=True)
class Named:
    rank: int
    error: str
    peer: int | None
    message: str
    at: float  # time.monotonic() of the catch (shared by the host's processes)


def _stop_rank(out: Path, mode: Mode, run: Run, env: RankEnv) -> None:
    watchdog(90)
    group = _group(mode)
    config = _config(STOP_P, STOP_TIMEOUT_S, mode)

    def stop(t: int) -> None:
        if env.rank == STOP_P - 1 and t == STOP_AT:
            write_json(out / "stop.json", {"at": time.monotonic(), "pid": os.getpid()})
            os.kill(os.getpid(), signal.SIGSTOP)

    pauses = {t: STOP_STEP_S for t in range(1, 100)}
    try:
        _run_loop(config, group, env.failure_board(group), run, 100, pauses, stop)
    except PPSyncError as e:
        write_json(out / f"rank{env.rank}.json", asdict(Named(
            env.rank, type(e).__name__, getattr(e, "peer", None), str(e), time.monotonic())))
    else:
        write_json(out / f"rank{env.rank}.json", asdict(Named(env.rank, "", None, "", 0.0)))
    if env.rank == 0:  # once every receiver said what it saw: end the stopped rank
        deadline = time.monotonic() + 30
        while (not all((out / f"rank{r}.json").exists() for r in range(STOP_P - 1))
               and time.monotonic() < deadline):
            time.sleep(0.1)
        os.kill(int(json.loads((out / "stop.json").read_text())["pid"]), signal.SIGKILL)


@pytest.mark.timeout(150)
@pytest.mark.parametrize(("mode", "run"), [("gloo", "sync"), ("twin", "asyncio")])
def test_a_stopped_last_rank_is_named_silent_within_silent_s(tmp_path: Path, mode: Mode,
                                                              run: Run) -> None:
    with pytest.raises(RankFailed) as info:  # the stopped rank, ended by rank 0
        spawn_ranks(functools.partial(_stop_rank, tmp_path, mode, run), STOP_P, timeout_s=80,
                    failed_grace_s=20)
    assert list(info.value.errors) == [STOP_P - 1], info.value.errors
    stopped = json.loads((tmp_path / "stop.json").read_text())
    for rank in range(STOP_P - 1):
        named = Named(**json.loads((tmp_path / f"rank{rank}.json").read_text()))
        assert named.error == "SyncTimeout", named
        assert named.peer == STOP_P - 1, named
        assert f"silent peer rank(s) {STOP_P - 1} (global)" in named.message, named
        after = named.at - float(stopped["at"])
        print(f"{mode} {run}: rank {rank} named the stopped rank {after:.2f} s after the stop")
        assert 0 < after <= SILENT_S + 1.0, (after, named)


# -- stuck but alive --------------------------------------------------------------------

STUCK_TIMEOUT_S = 3.0
STUCK_AT = 4
HANG_S = STUCK_TIMEOUT_S + 20  # the last rank's engine hangs, alive, far past the timeout


def _stuck_rank(out: Path, pp_size: int, mode: Mode, run: Run, env: RankEnv) -> None:
    watchdog(90)
    group = _group(mode)
    config = _config(pp_size, STUCK_TIMEOUT_S, mode)
    waits: list[float] = []

    def mark(t: int) -> None:
        waits.append(time.monotonic())

    try:
        _run_loop(config, group, env.failure_board(group), run, 40, {STUCK_AT: HANG_S}, mark)
    except PPSyncError as e:
        write_json(out / f"rank{env.rank}.json", {
            "error": type(e).__name__, "peer": getattr(e, "peer", None), "message": str(e),
            "at": time.monotonic(), "step_started": waits[-1]})
        return
    write_json(out / f"rank{env.rank}.json", {"error": "", "at": 0.0})


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("pp_size", "mode", "run"), [(2, "gloo", "asyncio"),
                                                      (3, "twin", "sync")])
def test_a_stuck_but_alive_peer_is_named_at_timeout_s_with_what_it_does(
        tmp_path: Path, pp_size: int, mode: Mode, run: Run) -> None:
    with contextlib.suppress(RankFailed):  # the hanging last rank is ended by the launcher
        spawn_ranks(functools.partial(_stuck_rank, tmp_path, pp_size, mode, run), pp_size,
                    timeout_s=60, failed_grace_s=5)
    timed_out = 0
    for rank in range(pp_size - 1):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert got["error"] == "SyncTimeout", got
        assert got["peer"] == pp_size - 1, got
        message = str(got["message"])
        # a receiver times out itself, or reads the first one's notice first
        timed_out += f"no completion within timeout_s = {STUCK_TIMEOUT_S} of the wait" in message
        assert f"rank {pp_size - 1} (PP stage {pp_size - 1}): alive, in its engine's step" \
            in message, got
        assert "silent" not in message, got
        # from the wait's start: the receiver's step began, then its consume waited
        after = float(got["at"]) - float(got["step_started"])
        assert STUCK_TIMEOUT_S <= after < STUCK_TIMEOUT_S + 2.5, (after, got)
    assert timed_out >= 1
