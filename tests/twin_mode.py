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
"""

from __future__ import annotations

import math
from typing import Literal

import torch.distributed as dist

from ppsync.core.wire.completion import STATS, emulate
from ppsync.schemas.config import SyncConfig

Mode = Literal["gloo", "twin", "xccl", "hang"]
MODES: tuple[Mode, ...] = ("gloo", "twin")
"""The modes every multi-rank suite runs in; the fault suites add the others."""


def in_mode(config: SyncConfig, mode: Mode) -> SyncConfig:
    """``config`` as ``mode`` runs it (twin: the device codec, fixed wire)."""
    if mode == "gloo":
        return config
    return config.model_copy(update={"codec": "device", "wire": "fixed"})


def mode_group(group: dist.ProcessGroup, mode: Mode) -> dist.ProcessGroup:
    """The token group ``group``, made to behave as ``mode`` says."""
    if mode == "twin":
        emulate(group)
    elif mode == "xccl":
        emulate(group, "xccl")
    elif mode == "hang":
        emulate(group, "nccl", abort_hang_s=math.inf)
    return group


def check_engine_stream(mode: Mode) -> None:
    """Twin modes: no engine-stream wait on an unconsumed transfer in this process."""
    if mode != "gloo":
        assert STATS.engine_waits_unconsumed == 0, (
            f"{STATS.engine_waits_unconsumed} engine-stream waits on unconsumed transfers; "
            "first at:\n" + "\n".join(STATS.where))
