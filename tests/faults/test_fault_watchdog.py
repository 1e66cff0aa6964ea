"""ppsync speaks before NCCL's watchdog (docs/design.md, "When they fail"),
on the CPU twin of NCCL, whose watchdog counts each work from its post
against the token group's own timeout (``max_pending_s`` + the NCCL margin,
shortened here) and terminates the process when it fires
(``TORCH_NCCL_ASYNC_ERROR_HANDLING=3``).

- A receiver posts a receive, then its engine idles, making no call, past
  that timeout, while the last rank is SIGSTOPped. The receiver's watcher
  names the stopped rank silent within ``silent_s`` + about a second and
  aborts the group, so its consume raises ppsync's SyncTimeout naming the
  stopped rank, and the watchdog never kills the receiver.
- The healthy twin: the last rank alive but slow (it sends the frame long
  after the post, far past ``timeout_s`` and ``silent_s``) while the
  receiver idles: the receive completes, the consume releases it, no error
  and no kill. (Bounded from its post, as before, this receive was failed.)
"""

from __future__ import annotations

import functools
import json
import os
import signal
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers import decode_view

from ppsync.core import SampledStep
from ppsync.core.path.token_path import TokenPath
from ppsync.core.wire.completion import emulate, semantics
from ppsync.core.wire.groups import token_group
from ppsync.errors import PPSyncError, RankFailed
from ppsync.harness.launcher import RankEnv, spawn_ranks
from ppsync.schemas.config import SyncConfig

TIMEOUT_S = 1.0
SILENT_S = 2.0
MAX_PENDING_S = 12.0
MARGIN_S = 3.0  # the NCCL margin, shortened: the twin's watchdog fires 15 s after a post
IDLE_S = MAX_PENDING_S + MARGIN_S + 3  # past the token group's own timeout
SLOW_S = 3 * SILENT_S + 2  # the healthy last rank's delay: past timeout_s and silent_s
CONFIG = SyncConfig.build(pp_size=2, max_num_reqs=8, timeout_s=TIMEOUT_S, codec="device",
                          carrier="device", ring_depth=1, silent_s=SILENT_S,
                          max_pending_s=MAX_PENDING_S)


@dataclass(frozen=True)
class Idle:
    error: str
    peer: int | None
    message: str
    idled_s: float
    released: int  # rows the consume released


def _rank(out: Path, stop: bool, env: RankEnv) -> None:
    group = token_group(dist.group.WORLD, timeout_s=60.0)  # type: ignore[arg-type]
    emulate(group, "nccl")
    path = TokenPath(CONFIG, group)
    pid_file = out / "last.pid"
    if path.is_last:
        pid_file.write_text(str(os.getpid()))
        if stop:
            os.kill(os.getpid(), signal.SIGSTOP)  # never sends frame 0
            return
        time.sleep(SLOW_S)  # alive (its watcher beats), slow
        n = 2
        path.publish(decode_view([0, 1]), SampledStep(
            torch.arange(n, dtype=torch.int64).reshape(n, 1), torch.ones(n, dtype=torch.int32),
            torch.zeros(n, dtype=torch.int32)))
        path.close()
        return
    assert path.consume() is None
    path.post(decode_view([0, 1]))  # frame 0's receive: pending from here
    t0 = time.monotonic()
    time.sleep(IDLE_S if stop else SLOW_S + 1)  # the engine idles, no call
    idle = Idle("", None, "consume returned", 0.0, 0)
    try:
        released = path.consume()
        idle = Idle("", None, "consume returned", 0.0,
                    0 if released is None else released.num_kept)
    except PPSyncError as e:
        idle = Idle(type(e).__name__, getattr(e, "peer", None), str(e), 0.0, 0)
    finally:
        if stop:
            os.kill(int(pid_file.read_text()), signal.SIGKILL)  # the stopped last rank
            path.close(drain=False)
        else:
            path.close()
    (out / "idle.json").write_text(json.dumps({**asdict(idle),
                                               "idled_s": time.monotonic() - t0}))


@pytest.mark.timeout(IDLE_S + 60)
def test_an_idle_receiver_gets_ppsyncs_error_not_the_watchdogs_kill(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(semantics, "NCCL_TIMEOUT_MARGIN_S", MARGIN_S)  # the ranks are forks
    with pytest.raises(RankFailed) as info:
        spawn_ranks(functools.partial(_rank, tmp_path, True), 2, timeout_s=IDLE_S + 20)
    # the receiver returned normally: only the last rank died, by our SIGKILL
    assert list(info.value.errors) == [1], info.value.errors
    assert info.value.errors[1] == f"rank 1 died (exit code -{signal.SIGKILL})"
    idle = Idle(**json.loads((tmp_path / "idle.json").read_text()))
    assert idle.idled_s >= IDLE_S, idle
    assert idle.error == "SyncTimeout", idle
    assert idle.peer == 1, idle
    assert "silent peer rank(s) 1 (global)" in idle.message, idle
    assert "silent past silent_s = 2" in idle.message, idle


@pytest.mark.timeout(SLOW_S + 60)
def test_a_slow_last_rank_is_waited_for_by_an_idle_receiver(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(semantics, "NCCL_TIMEOUT_MARGIN_S", MARGIN_S)
    spawn_ranks(functools.partial(_rank, tmp_path, False), 2, timeout_s=SLOW_S + 30)
    idle = Idle(**json.loads((tmp_path / "idle.json").read_text()))
    assert idle.error == "", idle
    assert idle.released == 2, idle
