"""ppsync's variables reach vLLM's Ray workers.

vLLM's Ray executors start each worker as a Ray actor on its node, whose
environment is the node's raylet's, and then copy variables from the
engine's process into it (read from vLLM 0.32's ``vllm/ray/ray_env.py`` and
``vllm/v1/executor/``):

- the older executor (``RayDistributedExecutor``; vLLM 0.32 picks it with
  ``VLLM_USE_RAY_V2_EXECUTOR_BACKEND=0``, and it was the only one before)
  copies vLLM's own variables and those whose name starts with one of its
  prefixes (``VLLM_``, ``NCCL_``, ``HF_``, ``UCX_``, ...) plus those of
  ``VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY`` (comma-separated, added to
  the defaults): ``PPSYNC_*`` is silently dropped, so the workers build
  vLLM's own handler while the engine's process has ``PPSYNC_VLLM=1``;
- the V2 executor (0.32's default) copies every variable of the engine's
  process but a few worker-specific ones: ``PPSYNC_*`` reaches the workers.

So when the plugin loads with ``PPSYNC_VLLM=1`` (in the engine's process,
before its executor exists) it adds ``PPSYNC_`` to
``VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY`` (:func:`ensure_ray_copies`),
which the older executor reads when it starts its workers; where vLLM has
already frozen its variables (``vllm.envs`` caches them once the engine is
up) and the prefix is not there, it fails in one line saying what to set.
Under the multiprocessing executor the variable is inherited and unused.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import MutableMapping

from ppsync.errors import ConfigError

__all__ = ["PREFIX", "RAY_PREFIXES_ENV", "VLLM_DEFAULT_PREFIXES", "copied_by_ray",
           "ensure_ray_copies", "with_prefix"]

RAY_PREFIXES_ENV = "VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY"
PREFIX = "PPSYNC_"
VLLM_DEFAULT_PREFIXES = frozenset({"VLLM_", "FLASH_ATTENTION_", "LMCACHE_", "NCCL_", "UCX_",
                                   "HF_", "HUGGING_FACE_"})
"""vLLM 0.32's ``DEFAULT_ENV_VAR_PREFIXES`` (vllm/ray/ray_env.py)."""


def _prefixes(extra: str) -> set[str]:
    """The older executor's prefixes: its defaults and the comma-separated
    ``extra`` (blank items dropped), as vLLM parses them."""
    return set(VLLM_DEFAULT_PREFIXES) | {p.strip() for p in extra.split(",") if p.strip()}


def copied_by_ray(env: MutableMapping[str, str], extra: str | None = None) -> set[str]:
    """The names of ``env`` the older executor copies by prefix (``extra``:
    its extra prefixes; None: ``env``'s own variable): the stand-in of
    vLLM's rule the tests check ppsync against."""
    prefixes = _prefixes(env.get(RAY_PREFIXES_ENV, "") if extra is None else extra)
    return {name for name in env if any(name.startswith(p) for p in prefixes)}


def with_prefix(extra: str) -> str | None:
    """``extra`` with ``PPSYNC_`` added; None when one of its prefixes
    already covers every ``PPSYNC_*`` name."""
    if any(PREFIX.startswith(p) for p in _prefixes(extra)):
        return None
    return f"{extra},{PREFIX}" if extra.strip() else PREFIX


def _frozen_value() -> str | None:
    """vLLM's value of the variable where vLLM has frozen its variables
    (``vllm.envs`` caching), else None (it reads the environment)."""
    try:
        envs = importlib.import_module("vllm.envs")
    except ImportError:
        return None
    if not getattr(envs, "_is_envs_cache_enabled", lambda: False)():
        return None
    return str(getattr(envs, RAY_PREFIXES_ENV, ""))


def ensure_ray_copies(env: MutableMapping[str, str] | None = None) -> bool:
    """Make vLLM's older Ray executor copy ``PPSYNC_*`` to its workers (see
    the module docstring); True when the variable was changed. ConfigError,
    one line, where vLLM froze a value without the prefix."""
    env = os.environ if env is None else env
    frozen = _frozen_value()
    if frozen is not None:
        if with_prefix(frozen) is not None:
            raise ConfigError(
                f"PPSYNC_VLLM=1, but vLLM read {RAY_PREFIXES_ENV} = {frozen!r} before ppsync's "
                "plugin loaded: its Ray executor will not copy PPSYNC_* to its workers (they "
                f"would run vLLM's own handler); set {RAY_PREFIXES_ENV}={PREFIX} before starting "
                "vLLM")
        return False
    new = with_prefix(env.get(RAY_PREFIXES_ENV, ""))
    if new is None:
        return False
    env[RAY_PREFIXES_ENV] = new
    return True
