"""ppsync: the pipeline-parallel token path for LLM serving engines.

The last rank of a PP group samples each step's tokens; ppsync delivers them
(with accepted counts and drafts) to every earlier rank, one frame per step,
checked, bounded in time, without blocking the engine's event loop.

Layers, bottom-up: ``ppsync.errors`` and ``ppsync.schemas`` (pydantic, no
torch) -> ``ppsync.core`` (torch + numpy, synchronous) -> ``ppsync.compat``
and ``ppsync.services`` (anyio) -> ``ppsync.debug`` (reading flight-recorder
dumps) -> ``ppsync.cli``.
"""

import importlib as _importlib
import importlib.util as _util
import typing as _typing

_MISSING = [name for name in ("numpy", "pydantic", "anyio") if _util.find_spec(name) is None]
if _MISSING:  # a CUDA image has torch and numpy but no pydantic: say what to do
    raise ModuleNotFoundError(
        f"ppsync needs {', '.join(_MISSING)}, which this Python lacks. Without a network "
        "(a GPU machine): `make gpu-wheels` where pip works, carry wheels/gpu, then "
        "`python3 -m pip install --no-index --find-links wheels/gpu ppsync` "
        "(docs/operations.md, \"GPU check\")", name=_MISSING[0])

if _typing.TYPE_CHECKING:  # the names, for readers and type checkers; loaded on first use
    from ppsync.compat import PPHandler
    from ppsync.compat.vllm.aux_relay import AuxRelay
    from ppsync.core import (
        BatchView,
        FailureBoard,
        ReleasedStep,
        SampledStep,
        TokenPath,
        batch_view_of,
        need_sampled_mask,
        pipeline_groups,
        strided_groups,
        token_group,
        token_group_among,
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
    "SampledStep",
    "StepRecord",
    "Stopped",
    "SyncConfig",
    "SyncTimeout",
    "TokenPath",
    "batch_view_of",
    "need_sampled_mask",
    "open_rank",
    "pipeline_groups",
    "strided_groups",
    "token_group",
    "token_group_among",
    "token_groups",
]

_WHERE = {
    "AuxRelay": "ppsync.compat.vllm.aux_relay",
    "BatchError": "ppsync.errors",
    "BatchView": "ppsync.core",
    "BroadcastService": "ppsync.services",
    "ConfigError": "ppsync.errors",
    "DesyncError": "ppsync.errors",
    "FailureBoard": "ppsync.core",
    "PPHandler": "ppsync.compat",
    "PPSyncError": "ppsync.errors",
    "PeerLost": "ppsync.errors",
    "ProtocolError": "ppsync.errors",
    "Rank": "ppsync.services",
    "RankFailed": "ppsync.errors",
    "RankReport": "ppsync.schemas",
    "ReceiveService": "ppsync.services",
    "ReleasedStep": "ppsync.core",
    "RoleError": "ppsync.errors",
    "RunReport": "ppsync.schemas",
    "SampledStep": "ppsync.core",
    "StepRecord": "ppsync.schemas",
    "Stopped": "ppsync.errors",
    "SyncConfig": "ppsync.schemas",
    "SyncTimeout": "ppsync.errors",
    "TokenPath": "ppsync.core",
    "batch_view_of": "ppsync.core",
    "need_sampled_mask": "ppsync.core",
    "open_rank": "ppsync.services",
    "pipeline_groups": "ppsync.core",
    "strided_groups": "ppsync.core",
    "token_group": "ppsync.core",
    "token_group_among": "ppsync.core",
    "token_groups": "ppsync.core",
}
"""Public name -> the module that defines it. Importing ``ppsync`` (and so
``ppsync --help``) loads none of them: torch is imported on first use."""


def __getattr__(name: str) -> object:
    where = _WHERE.get(name)
    if where is None:
        raise AttributeError(f"module 'ppsync' has no attribute {name!r}")
    value = getattr(_importlib.import_module(where), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
