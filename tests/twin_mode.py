"""The multi-rank suites run in several completion modes (docs/design.md,
"The CPU twin"): "gloo" as it is, where a work's future completes with the
transfer, and "twin", gloo ranks whose token group behaves as NCCL's
(ppsync.core.wire.completion.twin): futures complete at enqueue, streams run
later than the host. In twin mode frames are the device codec's (NCCL takes
device tensors only) on a fixed wire, and a rank ends by checking that its
engine's stream never waited on a transfer it had not consumed.

The fault suites add two twin modes: "xccl" (XCCL's semantics: no abort, a
dead peer's receive stays pending) and "hang" (NCCL's, with an abort that
never returns, as ``ncclCommAbort`` may not when another communicator is
stuck on the same dead peer).

"carried": the twin of a CUDA device whose frames go by the host carrier
(the default on a GPU): the stand-in streams (running ``CARRIED_LAG_S``
behind the host, as a device does) order the device codec's copies to and
from pinned memory, and the frames travel over plain gloo.
"""

from __future__ import annotations

import math
from typing import Literal

import torch.distributed as dist

from ppsync.core.codec.carriers import STATS as COPY_STATS
from ppsync.core.wire.completion import STATS, emulate
from ppsync.schemas.config import SyncConfig

Mode = Literal["gloo", "twin", "xccl", "hang", "carried"]
MODES: tuple[Mode, ...] = ("gloo", "twin")
"""The modes every multi-rank suite runs in; the fault suites add the others."""


CARRIED_LAG_S = 0.002
"""How far the "carried" mode's stand-in streams run behind the host."""
CARRIED_ENV = {"PPSYNC_TWIN_LAG_S": str(CARRIED_LAG_S)}
"""The same, for a handler that emulates its own token group (spawn_ranks' env)."""


def in_mode(config: SyncConfig, mode: Mode) -> SyncConfig:
    """``config`` as ``mode`` runs it (twins: the device codec, fixed wire;
    the frames on the twin of the backend, or by the host carrier)."""
    if mode == "gloo":
        return config
    carrier = "host" if mode == "carried" else "device"
    return config.model_copy(update={"codec": "device", "wire": "fixed", "carrier": carrier})


def mode_group(group: dist.ProcessGroup, mode: Mode) -> dist.ProcessGroup:
    """The token group ``group``, made to behave as ``mode`` says."""
    if mode == "twin":
        emulate(group)
    elif mode == "xccl":
        emulate(group, "xccl")
    elif mode == "hang":
        emulate(group, "nccl", abort_hang_s=math.inf)
    elif mode == "carried":
        emulate(group, "nccl", carrier="host", lag_s=CARRIED_LAG_S)
    return group


def check_engine_stream(mode: Mode) -> None:
    """Twin modes: no engine-stream wait on an unconsumed transfer in this
    process; the host carrier's: no pinned buffer reused before its copy
    ended, and no thread waited for a frame's copy before its send."""
    if mode == "carried":
        early, waits = COPY_STATS.reused_early, COPY_STATS.copy_waits
        assert early == 0, f"{early} pinned buffers reused early"
        assert waits == 0, f"{waits} waits for a frame's copy to pinned memory"
    if mode != "gloo":
        assert STATS.engine_waits_unconsumed == 0, (
            f"{STATS.engine_waits_unconsumed} engine-stream waits on unconsumed transfers; "
            "first at:\n" + "\n".join(STATS.where))
