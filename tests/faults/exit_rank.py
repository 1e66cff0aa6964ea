"""One rank of ``test_fault_exit``, as an engine would run it: a plain Python
process (not a fork of the test), configured by the environment, that leaves
through the interpreter's normal exit, never ``os._exit``.

Arguments: MODE (sync, asyncio, trio; twin-MODE on the CPU twin of NCCL, xccl-MODE
on XCCL's, hang-MODE on NCCL's with an abort that never returns) VICTIM
HOW (kill, stop) PORT GROUP_TIMEOUT_S.
The world's store, which also holds the failure board, is served by the test
process at 127.0.0.1:PORT. At step ``FAULT_AT`` the victim SIGKILLs or
SIGSTOPs itself; a survivor prints one JSON line saying what it caught and
when (CLOCK_MONOTONIC, shared by every process of the host), then returns
from ``main``: its exit status is the interpreter's own.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import cast

import anyio
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/: helpers
from helpers import engine_step, sync_engine_step
from torch._C._distributed_c10d import PrefixStore, TCPStore
from twin_mode import Mode, in_mode, mode_group

from ppsync.core.path.token_path import TokenPath
from ppsync.core.wire.board import FailureBoard
from ppsync.core.wire.groups import token_group
from ppsync.errors import PPSyncError
from ppsync.harness.driver import StepLoop, workload_config
from ppsync.schemas.config import SyncConfig
from ppsync.services.runtime import open_rank

PP_SIZE = 3
TIMEOUT_S = 5.0  # the token path's own bound
FAULT_AT = 50
STEPS = 100_000  # far more than the survivors run before the fault stops them


def _fault(rank: int, victim: int, how: str, t: int) -> None:
    if rank == victim and t == FAULT_AT:
        print(json.dumps({"rank": rank, "fault_at": time.monotonic()}), flush=True)
        os.kill(os.getpid(), signal.SIGKILL if how == "kill" else signal.SIGSTOP)


def _sync(config: SyncConfig, group: dist.ProcessGroup, board: FailureBoard,
          victim: int, how: str) -> None:
    path = TokenPath(config, group, board=board)
    try:
        loop = StepLoop(workload_config(config, steps=STEPS, seed=1), path.is_last, path.rank)
        for t in range(loop.total_steps):
            _fault(dist.get_rank(), victim, how, t)
            sync_engine_step(path, loop, t)
    finally:
        path.close(drain=False)  # what an engine does on an error


async def _async(config: SyncConfig, group: dist.ProcessGroup, board: FailureBoard,
                 victim: int, how: str) -> None:
    async with open_rank(config, group, board=board) as rank:
        loop = StepLoop(workload_config(config, steps=STEPS, seed=1), rank.is_last, rank.rank)
        for t in range(loop.total_steps):
            _fault(dist.get_rank(), victim, how, t)
            await engine_step(rank, loop, t)


def main() -> None:
    mode, victim, how = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    # "<twin>-<mode>": the token group behaves as NCCL's (twin), XCCL's
    # (xccl) or NCCL's with a hanging abort (hang); tests/twin_mode.py
    completion: Mode = "gloo"
    if "-" in mode:
        twin, mode = mode.split("-", 1)
        completion = cast(Mode, twin)
    port, group_timeout = int(sys.argv[4]), float(sys.argv[5])
    rank = int(os.environ["RANK"])
    store = TCPStore("127.0.0.1", port, is_master=False,
                     timeout=datetime.timedelta(seconds=30))
    dist.init_process_group("gloo", store=PrefixStore("world", store), rank=rank,
                            world_size=PP_SIZE,
                            timeout=datetime.timedelta(seconds=group_timeout))
    config = SyncConfig.build(pp_size=PP_SIZE, max_num_reqs=16, num_speculative_steps=2,
                              timeout_s=TIMEOUT_S)
    # the token group's own timeout may exceed the token path's (an engine's choice)
    group = token_group(dist.group.WORLD, timeout_s=group_timeout)  # type: ignore[arg-type]
    mode_group(group, completion)
    config = in_mode(config, completion)
    board = FailureBoard(store, ranks=list(range(PP_SIZE)), me=rank)
    try:
        if mode == "sync":
            _sync(config, group, board, victim, how)
        else:
            anyio.run(_async, config, group, board, victim, how, backend=mode)
    except PPSyncError as e:
        print(json.dumps({"rank": rank, "error": type(e).__name__,
                          "peer": getattr(e, "peer", None), "message": str(e),
                          "at": time.monotonic()}), flush=True)
    else:
        print(json.dumps({"rank": rank, "error": "", "at": time.monotonic()}), flush=True)


if __name__ == "__main__":
    main()
