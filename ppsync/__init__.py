"""ppsync: the pipeline-parallel token path for LLM serving engines.

The last rank of a PP group samples each step's tokens; ppsync delivers them
(with accepted counts and drafts) to every earlier rank, one frame per step,
checked, bounded in time, without blocking the engine's event loop.

Layers, bottom-up: ``ppsync.errors`` and ``ppsync.schemas`` (pydantic, no
torch) -> ``ppsync.core`` (torch + numpy, synchronous) -> ``ppsync.compat``
and ``ppsync.services`` (anyio) -> ``ppsync.debug`` (reading flight-recorder
dumps) -> ``ppsync.cli``.
"""

from ppsync.compat import PPHandler
from ppsync.core import (
    AuxRelay,
    BatchView,
    FailureBoard,
    ReleasedStep,
    TokenPath,
    batch_view_of,
    need_sampled_mask,
    pipeline_layout,
    strided_layout,
    token_group,
    token_group_in_layout,
    token_groups,
)
from ppsync.errors import (
    BatchError,
    ConfigError,
    DesyncError,
    PeerLost,
    PPSyncError,
    ProtocolError,
    RankFailed,
    RoleError,
    Stopped,
    SyncTimeout,
)
from ppsync.schemas import RankReport, RunReport, StepRecord, SyncConfig
from ppsync.services import BroadcastService, Rank, ReceiveService, open_rank

__version__ = "0.1.0"

__all__ = [
    "AuxRelay",
    "BatchError",
    "BatchView",
    "BroadcastService",
    "ConfigError",
    "DesyncError",
    "FailureBoard",
    "PPHandler",
    "PPSyncError",
    "PeerLost",
    "ProtocolError",
    "Rank",
    "RankFailed",
    "RankReport",
    "ReceiveService",
    "ReleasedStep",
    "RoleError",
    "RunReport",
    "StepRecord",
    "Stopped",
    "SyncConfig",
    "SyncTimeout",
    "TokenPath",
    "batch_view_of",
    "need_sampled_mask",
    "open_rank",
    "pipeline_layout",
    "strided_layout",
    "token_group",
    "token_group_in_layout",
    "token_groups",
]
