"""The SGLang plugin: ppsync's guard on every PP message of SGLang's PP loop.

SGLang runs every entry point of the group ``sglang.srt.plugins`` in each
of its processes, the schedulers included (unless ``SGLANG_PLUGINS`` names
others), then applies the hooks they registered. ppsync declares
:func:`register` there as ``ppsync``. It does nothing unless
``PPSYNC_SGLANG=1``. Then, for a supported SGLang release
(:data:`SUPPORTED`), it registers the AROUND hooks of
ppsync.compat.sglang.hooks on ``SchedulerPPMixin`` and puts
:func:`ppsync.compat.sglang.hooks.bounded` in the place of
``torch.distributed.irecv`` and ``isend``; another release is refused with a one-line
ConfigError (SGLang logs it and runs without the guard), since the hooks
lean on the PP loop's private functions, which change between releases.

SGLang is imported only here and only when switched on.
"""

from __future__ import annotations

import importlib
import logging
import os
from importlib import metadata

import torch.distributed as dist

from ppsync.compat.sglang.hooks import HOOKS, RECEIVE, SEND, bounded
from ppsync.errors import ConfigError

__all__ = ["ENV_SWITCH", "SUPPORTED", "check_release", "register"]

ENV_SWITCH = "PPSYNC_SGLANG"
"""``PPSYNC_SGLANG=1`` switches the plugin on; any other value or none: off."""
SUPPORTED = ("0.5.23",)
"""SGLang releases whose PP loop the hooks were read against and run with."""
_REGISTRY = "sglang.srt.plugins.hook_registry"

log = logging.getLogger("ppsync.sglang")
_registered: list[bool] = []


def check_release(version: str | None) -> str:
    """``version`` if the hooks support it, else ConfigError in one line."""
    if version is None:
        raise ConfigError(f"{ENV_SWITCH}=1 but SGLang is not installed here")
    if version not in SUPPORTED:
        raise ConfigError(
            f"ppsync's SGLang guard supports SGLang {', '.join(SUPPORTED)}, not the installed "
            f"{version}: its PP loop's hooked functions may differ; SGLang runs without the "
            f"guard (unset {ENV_SWITCH} to silence this)")
    return version


def _installed() -> str | None:
    try:
        return metadata.version("sglang")
    except metadata.PackageNotFoundError:
        return None


def register() -> None:
    """SGLang's entry point: with ``PPSYNC_SGLANG=1`` and a supported
    release, hook the PP loop (once per process); otherwise do nothing, or
    refuse with a ConfigError."""
    if os.environ.get(ENV_SWITCH) != "1" or _registered:
        return
    check_release(_installed())
    registry = importlib.import_module(_REGISTRY)
    for target, hook in HOOKS.items():
        registry.HookRegistry.register(target, hook, registry.HookType.AROUND)
    dist.irecv = bounded(dist.irecv, RECEIVE)
    dist.isend = bounded(dist.isend, SEND)
    _registered.append(True)
    log.info("ppsync: SGLang PP guard hooks registered (%s=1)", ENV_SWITCH)
