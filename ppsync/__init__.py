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

if _typing.TYPE_CHECKING:  # the names for type checkers (``X as X``: re-exported)
    from ppsync.compat import PPHandler as PPHandler
    from ppsync.compat.vllm.aux_relay import AuxRelay as AuxRelay
    from ppsync.core import BatchView as BatchView
    from ppsync.core import FailureBoard as FailureBoard
    from ppsync.core import ReleasedStep as ReleasedStep
    from ppsync.core import SampledStep as SampledStep
    from ppsync.core import TokenPath as TokenPath
    from ppsync.core import batch_view_of as batch_view_of
    from ppsync.core import need_sampled_mask as need_sampled_mask
    from ppsync.core import pipeline_groups as pipeline_groups
    from ppsync.core import strided_groups as strided_groups
    from ppsync.core import token_group as token_group
    from ppsync.core import token_group_among as token_group_among
    from ppsync.core import token_groups as token_groups
    from ppsync.errors import BatchError as BatchError
    from ppsync.errors import ConfigError as ConfigError
    from ppsync.errors import DesyncError as DesyncError
    from ppsync.errors import PeerLost as PeerLost
    from ppsync.errors import PPSyncError as PPSyncError
    from ppsync.errors import ProtocolError as ProtocolError
    from ppsync.errors import RankFailed as RankFailed
    from ppsync.errors import RoleError as RoleError
    from ppsync.errors import Stopped as Stopped
    from ppsync.errors import SyncTimeout as SyncTimeout
    from ppsync.schemas import RankReport as RankReport
    from ppsync.schemas import RunReport as RunReport
    from ppsync.schemas import StepRecord as StepRecord
    from ppsync.schemas import SyncConfig as SyncConfig
    from ppsync.services import BroadcastService as BroadcastService
    from ppsync.services import Rank as Rank
    from ppsync.services import ReceiveService as ReceiveService
    from ppsync.services import open_rank as open_rank

__version__ = "0.1.0"

_PUBLIC: dict[str, tuple[str, ...]] = {
    "ppsync.errors": ("BatchError", "ConfigError", "DesyncError", "PPSyncError", "PeerLost",
                      "ProtocolError", "RankFailed", "RoleError", "Stopped", "SyncTimeout"),
    "ppsync.schemas": ("RankReport", "RunReport", "StepRecord", "SyncConfig"),
    "ppsync.core": ("BatchView", "FailureBoard", "ReleasedStep", "SampledStep", "TokenPath",
                    "batch_view_of", "need_sampled_mask", "pipeline_groups", "strided_groups",
                    "token_group", "token_group_among", "token_groups"),
    "ppsync.compat": ("PPHandler",),
    "ppsync.compat.vllm.aux_relay": ("AuxRelay",),
    "ppsync.services": ("BroadcastService", "Rank", "ReceiveService", "open_rank"),
}
"""The public names, once: the module that defines each. ``__all__`` and the
loader below read it; the imports under TYPE_CHECKING above restate it for
type checkers (tests/test_public_api.py holds the two equal). Importing
``ppsync`` (and so ``ppsync --help``) loads none of them: torch is imported
on first use."""
_WHERE = {name: module for module, names in _PUBLIC.items() for name in names}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> object:
    where = _WHERE.get(name)
    if where is None:
        raise AttributeError(f"module 'ppsync' has no attribute {name!r}")
    value = getattr(_importlib.import_module(where), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
