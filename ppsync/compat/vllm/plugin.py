"""The vLLM plugin: makes vLLM's Model Runner V2 build ppsync's handler.

vLLM loads every entry point of the group ``vllm.general_plugins`` in each of
its processes, workers included (unless ``VLLM_PLUGINS`` names others);
ppsync declares :func:`register` there as ``ppsync``. It does nothing unless
``PPSYNC_VLLM=1``. Then it puts the handler class of the installed vLLM's
interface, made with vLLM's arguments (:func:`vllm_handler_class`), in the place of the
``PPHandler`` name in ``vllm.v1.worker.gpu.pp_utils`` and in the model runner
module ``vllm.v1.worker.gpu.model_runner``, which binds that name when it is
imported (so: now if it already is, else at its import, from pp_utils). The
model runner then builds ppsync's handler exactly where it built its own,
``PPHandler(max_num_reqs=..., num_speculative_steps=..., device=...)``, and
drives it through the same calls. Registering again changes nothing.

vLLM is imported only here and only when switched on: the rest of ppsync
never needs it.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys

import torch

from ppsync.compat.vllm.handler import PPHandler
from ppsync.compat.vllm.versions import handler_class, resolve_interface
from ppsync.errors import ConfigError

__all__ = ["ENV_SWITCH", "MODEL_RUNNER", "PP_UTILS", "VllmPPHandler", "register",
           "vllm_handler_class"]

ENV_SWITCH = "PPSYNC_VLLM"
"""``PPSYNC_VLLM=1`` switches the plugin on; any other value or none: off."""
PP_UTILS = "vllm.v1.worker.gpu.pp_utils"
MODEL_RUNNER = "vllm.v1.worker.gpu.model_runner"
PARALLEL_STATE = "vllm.distributed.parallel_state"
_NAME = "PPHandler"  # the name replaced in both modules

log = logging.getLogger("ppsync.vllm")


class VllmPPHandler(PPHandler):
    """ppsync's handler, built with the arguments vLLM's model runner passes
    its own and with vLLM's PP group (``get_pp_group().device_group``); the
    interface follows the installed vLLM's version."""

    def __init__(self, max_num_reqs: int, num_speculative_steps: int,
                 device: torch.device) -> None:
        try:
            get_pp_group = importlib.import_module(PARALLEL_STATE).get_pp_group
        except (ImportError, AttributeError) as e:
            raise ConfigError(f"the ppsync vLLM plugin needs {PARALLEL_STATE}.get_pp_group "
                              f"({e})") from None
        group = get_pp_group().device_group
        # the default failure board lives in the token group's own store (the
        # world's), so a desync or a lost peer one rank sees reaches every rank
        super().__init__(max_num_reqs, num_speculative_steps, device, group=group)


_bound: dict[str, type[VllmPPHandler]] = {}


def vllm_handler_class(interface: str | None = None) -> type[VllmPPHandler]:
    """The class the plugin binds: the installed vLLM's interface (or
    ``interface``) built with vLLM's own arguments and PP group. One class
    per interface, made once."""
    name = resolve_interface(interface)
    if name not in _bound:
        base = handler_class(name)
        _bound[name] = type(f"Vllm{base.__name__}", (VllmPPHandler, base), {
            "__doc__": f"{base.__doc__} Built by vLLM's model runner (the plugin)."})
    return _bound[name]


def register() -> None:
    """vLLM's entry point: with ``PPSYNC_VLLM=1``, replace vLLM's PPHandler
    by :class:`VllmPPHandler`; otherwise do nothing."""
    if os.environ.get(ENV_SWITCH) != "1":
        return
    try:
        pp_utils = importlib.import_module(PP_UTILS)
    except ImportError as e:
        raise ConfigError(f"{ENV_SWITCH}=1 but vLLM's {PP_UTILS} cannot be imported ({e}); "
                          "ppsync replaces the PPHandler of vLLM's Model Runner V2") from None
    if not hasattr(pp_utils, _NAME):
        raise ConfigError(f"{ENV_SWITCH}=1 but {PP_UTILS} has no {_NAME} to replace "
                          "(a vLLM without Model Runner V2's PPHandler: before 0.23)")
    cls = vllm_handler_class()  # chosen once, by the installed version
    already = getattr(pp_utils, _NAME) is cls
    setattr(pp_utils, _NAME, cls)
    runner = sys.modules.get(MODEL_RUNNER)  # imported later: it binds ours from pp_utils
    if runner is not None and hasattr(runner, _NAME):
        setattr(runner, _NAME, cls)
    if not already:
        log.info("ppsync: vLLM's PPHandler replaced by %s.%s (interface %s; %s=1)", __name__,
                 cls.__name__, cls.interface, ENV_SWITCH)
