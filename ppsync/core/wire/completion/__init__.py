"""A token group's completion semantics, chosen once per group: host-completed
(gloo) or stream-ordered (NCCL, XCCL, and the CPU twin of them). See
ppsync.core.wire.completion.semantics for what each means, and
ppsync.core.wire.completion.twin for the twin.
"""

from __future__ import annotations

import torch.distributed as dist

from ppsync.core.wire.backends import BACKENDS
from ppsync.core.wire.completion.semantics import Completion, HostCompleted, StreamOrdered
from ppsync.core.wire.completion.twin import (
    EMULATED,
    STATS,
    TwinCompleted,
    TwinHostCarried,
    emulate,
    twin_of,
)

__all__ = ["EMULATED", "STATS", "STREAM_ORDERED_BACKENDS", "Completion", "HostCompleted",
           "StreamOrdered", "completion_for", "emulate"]

STREAM_ORDERED_BACKENDS = tuple(b.name for b in BACKENDS if b.stream_ordered)
"""Backends whose works complete at enqueue (their futures say nothing of the transfer)."""


def completion_for(group: dist.ProcessGroup, backend: str) -> Completion:
    """The semantics of ``group`` (backend ``backend``): the one place the choice is made."""
    twin = twin_of(group)
    if twin is not None:
        return TwinCompleted(twin) if twin.carries else TwinHostCarried(twin)
    if backend in STREAM_ORDERED_BACKENDS:
        return StreamOrdered(backend)
    return HostCompleted()
