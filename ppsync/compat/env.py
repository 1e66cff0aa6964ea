"""The bounds an operator sets through the environment for ppsync's
plugins, vLLM's and SGLang's: read and checked here, once, for both, with
the bounds of the SyncConfig fields they set (ppsync.schemas.bounds). An
empty value counts as unset.

- ``PPSYNC_TIMEOUT_S``: ``SyncConfig.timeout_s``, the bound on one wait for a
  live peer (unset: ppsync.schemas.config.DEFAULT_TIMEOUT_S);
- ``PPSYNC_SILENT_S``: ``SyncConfig.silent_s``, how long a peer's heartbeat
  may stop before it is named silent (unset: DEFAULT_SILENT_S).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from ppsync.errors import ConfigError
from ppsync.schemas.bounds import field_bounds, rule_text, within
from ppsync.schemas.config import DEFAULT_SILENT_S, DEFAULT_TIMEOUT_S, SyncConfig

__all__ = ["BOUND_VARS", "ENV_SILENT", "ENV_TIMEOUT", "Bounds", "bounds_from_env"]

ENV_TIMEOUT = "PPSYNC_TIMEOUT_S"
ENV_SILENT = "PPSYNC_SILENT_S"
BOUND_VARS = {ENV_TIMEOUT: "timeout_s", ENV_SILENT: "silent_s"}
"""Each variable and the SyncConfig field it sets."""


@dataclass(frozen=True)
class Bounds:
    """The waits' bounds as the operator's variables give them."""

    timeout_s: float = DEFAULT_TIMEOUT_S
    silent_s: float = DEFAULT_SILENT_S


def bounds_from_env(env: Mapping[str, str]) -> Bounds:
    """The bounds ``env`` gives; ConfigError, in one line naming the
    variable, its value and the rule, for a bad one."""
    values: dict[str, float] = {}
    for name, field in BOUND_VARS.items():
        raw = env.get(name, "").strip()
        if not raw:
            continue
        try:
            value = float(raw)
        except ValueError:
            value = math.nan
        limits = field_bounds(SyncConfig, field)
        if not (math.isfinite(value) and within(value, limits)):
            raise ConfigError(f"{name} = {raw!r} must be a number of seconds "
                              f"{rule_text(*limits)}")
        values[field] = value
    return Bounds(**values)
