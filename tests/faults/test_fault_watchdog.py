"""ppsync's bound comes before NCCL's watchdog (docs/design.md, "When they
fail"), on the CPU twin of NCCL, whose watchdog counts each work from its
post against the token group's own timeout (``timeout_s`` + 30 s) and
terminates the process when it fires (``TORCH_NCCL_ASYNC_ERROR_HANDLING=3``).

A receiver posts a receive, then its engine idles past that timeout before
the consume, while the last rank is SIGSTOPped. ppsync bounds the transfer
from its post (ppsync.core.wire.completion.guard), so the consume raises
ppsync's SyncTimeout naming the stopped rank, and the watchdog never kills
the receiver. (Bounded from the consume alone, as before, the watchdog
terminated the receiver 31 s after the post.)
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
import torch.distributed as dist
from helpers import decode_view

from ppsync.core.path.token_path import TokenPath
from ppsync.core.wire.completion import emulate
from ppsync.core.wire.completion.base import NCCL_TIMEOUT_MARGIN_S
from ppsync.core.wire.groups import token_group
from ppsync.errors import PPSyncError, RankFailed
from ppsync.harness.launcher import RankEnv, spawn_ranks
from ppsync.schemas.config import SyncConfig

TIMEOUT_S = 1.0
IDLE_S = TIMEOUT_S + NCCL_TIMEOUT_MARGIN_S + 3  # past the token group's own timeout
CONFIG = SyncConfig.build(pp_size=2, max_num_reqs=8, timeout_s=TIMEOUT_S, codec="device",
                          ring_depth=1)


@dataclass(frozen=True)
class Idle:
    error: str
    peer: int | None
    message: str
    idled_s: float


def _rank(out: Path, env: RankEnv) -> None:
    group = token_group(dist.group.WORLD, timeout_s=60.0)  # type: ignore[arg-type]
    emulate(group, "nccl")
    path = TokenPath(CONFIG, group)
    pid_file = out / "last.pid"
    if path.is_last:
        pid_file.write_text(str(os.getpid()))
        os.kill(os.getpid(), signal.SIGSTOP)  # never sends frame 0
        return
    assert path.consume() is None
    path.post(decode_view([0, 1]))  # frame 0's receive: pending from here
    t0 = time.monotonic()
    time.sleep(IDLE_S)  # the engine idles; the watchdog's clock runs from the post
    idle = Idle("", None, "consume returned", 0.0)
    try:
        path.consume()
    except PPSyncError as e:
        idle = Idle(type(e).__name__, getattr(e, "peer", None), str(e), 0.0)
    finally:
        os.kill(int(pid_file.read_text()), signal.SIGKILL)  # the stopped last rank
        path.close(drain=False)
    (out / "idle.json").write_text(json.dumps({**asdict(idle),
                                               "idled_s": time.monotonic() - t0}))


@pytest.mark.timeout(IDLE_S + 60)
def test_an_idle_receiver_gets_ppsyncs_timeout_not_the_watchdogs_kill(tmp_path: Path) -> None:
    with pytest.raises(RankFailed) as info:
        spawn_ranks(functools.partial(_rank, tmp_path), 2, timeout_s=IDLE_S + 20)
    # the receiver returned normally: only the last rank died, by our SIGKILL
    assert list(info.value.errors) == [1], info.value.errors
    assert info.value.errors[1] == f"rank 1 died (exit code -{signal.SIGKILL})"
    idle = Idle(**json.loads((tmp_path / "idle.json").read_text()))
    assert idle.idled_s >= IDLE_S, idle
    assert idle.error == "SyncTimeout", idle
    assert idle.peer == 1, idle
    assert "silent peer rank(s) 1 (global)" in idle.message, idle
    assert "frame 0" in idle.message, idle
