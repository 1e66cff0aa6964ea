"""The multi-rank suites run in both completion modes (docs/design.md, "The
CPU twin"): "gloo" as it is, where a work's future completes with the
transfer, and "twin", gloo ranks whose token group behaves as NCCL's
(ppsync.core.completion.twin): futures complete at enqueue, streams run
later than the host. In twin mode frames are the device codec's (NCCL takes
device tensors only) on a fixed wire, and a rank ends by checking that its
engine's stream never waited on a transfer it had not consumed.
"""

from __future__ import annotations

from typing import Literal

import torch.distributed as dist

from ppsync.core.completion import STATS, emulate
from ppsync.schemas.config import SyncConfig

Mode = Literal["gloo", "twin"]
MODES: tuple[Mode, ...] = ("gloo", "twin")


def in_mode(config: SyncConfig, mode: Mode) -> SyncConfig:
    """``config`` as ``mode`` runs it (twin: the device codec, fixed wire)."""
    if mode == "gloo":
        return config
    return config.model_copy(update={"codec": "device", "wire": "fixed"})


def mode_group(group: dist.ProcessGroup, mode: Mode) -> dist.ProcessGroup:
    """The token group ``group``, made to behave as NCCL's in twin mode."""
    if mode == "twin":
        emulate(group)
    return group


def check_engine_stream(mode: Mode) -> None:
    """Twin mode: no engine-stream wait on an unconsumed transfer in this process."""
    if mode == "twin":
        assert STATS.engine_waits_unconsumed == 0, (
            f"{STATS.engine_waits_unconsumed} engine-stream waits on unconsumed transfers; "
            "first at:\n" + "\n".join(STATS.where))
