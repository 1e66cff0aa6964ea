"""The vLLM plugin: makes vLLM's Model Runner V2 build ppsync's handler.

vLLM loads every entry point of the group ``vllm.general_plugins`` in each of
its processes, workers included (unless ``VLLM_PLUGINS`` names others);
ppsync declares :func:`register` there as ``ppsync``. It does nothing unless
``PPSYNC_VLLM=1``. Then it picks the interfaces once (:func:`chosen_interfaces`:
``PPSYNC_VLLM_INTERFACE`` if set, else the installed vLLM's version through
the table of ppsync.compat.vllm.versions) and, for each runner, puts that
interface's handler class, made with vLLM's arguments
(:func:`vllm_handler_class`), in the place of the ``PPHandler`` name in
the runner's ``pp_utils`` module and in the model runner module that binds
that name when it is imported (so: now if it already is, else at its
import, from pp_utils):

- the GPU runner (which the x86 CPU and XPU runners subclass):
  ``vllm.v1.worker.gpu.pp_utils`` and ``vllm.v1.worker.gpu.model_runner``,
  built as ``PPHandler(max_num_reqs=..., num_speculative_steps=...,
  device=...)``;
- the standalone CPU runner (vLLM 0.34 on): ``vllm.v1.worker.cpu.pp_utils``
  and ``vllm.v1.worker.cpu.standalone_model_runner``, built as
  ``PPHandler(max_num_reqs=..., device=...)``; where that module cannot be
  imported (a vLLM built for another device) it is left alone, and logged.

The operator's settings (``PPSYNC_CODEC``, ``PPSYNC_CPU_KERNELS``,
``PPSYNC_DEVICE_KERNELS``, ``PPSYNC_TIMEOUT_S``, ``PPSYNC_SILENT_S``, ``PPSYNC_EMULATE``,
``PPSYNC_DUMP_DIR``: ppsync.compat.vllm.settings) are read and checked here,
first: a bad value is a ConfigError in every process at load, before
anything is replaced. A handler call that raises on a PP rank other than
the last ends its worker (``PPSYNC_VLLM_ON_ERROR``, :func:`_leaving`).
The model runner then builds ppsync's handler, with those settings,
exactly where it built its own and drives it through the same calls.
Registering again changes nothing. A vLLM older than 0.23 (no PPHandler)
is a ConfigError; one newer than the table is left with its own handler,
and a warning says why, unless ``PPSYNC_VLLM_INTERFACE`` names the interfaces to serve it with.

vLLM is imported only here and only when switched on: the rest of ppsync
never needs it.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.metadata
import logging
import os
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ppsync.compat.vllm.agreement import Peers, agree, facts_here
from ppsync.compat.vllm.handler import HANDLER_CALLS, PPHandler, handler_class
from ppsync.compat.vllm.ray_env import PREFIX, RAY_PREFIXES_ENV, ensure_ray_copies
from ppsync.compat.vllm.settings import ENV_ON_ERROR, PluginSettings, plugin_settings
from ppsync.compat.vllm.v0_34_cpu import PPHandler034Cpu
from ppsync.compat.vllm.versions import (
    DEFAULT_INTERFACE,
    ENV_INTERFACE,
    INTERFACES,
    Interface,
    Runner,
    installed_vllm_version,
    interface_for_version,
    interfaces_from_env,
    newer_than_table,
    resolve_interface,
)
from ppsync.core.recorder.on_error import dump_on_error
from ppsync.core.wire.teardown import end_now
from ppsync.errors import ConfigError

__all__ = ["CPU_MODEL_RUNNER", "CPU_PP_UTILS", "ENV_SWITCH", "EXIT_STATUS", "HANDLER_CALLS",
           "LEAVE_HOOKS", "MODEL_RUNNER", "PP_UTILS", "VllmCpuPPHandler", "VllmPPHandler",
           "chosen_interfaces", "leave_line", "register", "vllm_handler_class"]

ENV_SWITCH = "PPSYNC_VLLM"
"""``PPSYNC_VLLM=1`` switches the plugin on; any other value or none: off."""
PP_UTILS = "vllm.v1.worker.gpu.pp_utils"
MODEL_RUNNER = "vllm.v1.worker.gpu.model_runner"
CPU_PP_UTILS = "vllm.v1.worker.cpu.pp_utils"
CPU_MODEL_RUNNER = "vllm.v1.worker.cpu.standalone_model_runner"
MODULES: dict[Runner, tuple[str, str]] = {"gpu": (PP_UTILS, MODEL_RUNNER),
                                          "cpu": (CPU_PP_UTILS, CPU_MODEL_RUNNER)}
"""Each runner's (pp_utils, model runner) modules."""
PARALLEL_STATE = "vllm.distributed.parallel_state"
_NAME = "PPHandler"  # the name replaced in both modules

log = logging.getLogger("ppsync.vllm")


def _vllm_pp_group() -> dist.ProcessGroup:
    try:
        get_pp_group = importlib.import_module(PARALLEL_STATE).get_pp_group
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"the ppsync vLLM plugin needs {PARALLEL_STATE}.get_pp_group "
                          f"({e})") from None
    group: dist.ProcessGroup = get_pp_group().device_group
    return group


def _ppsync_version() -> str:
    try:
        return importlib.metadata.version("ppsync")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _agree(group: dist.ProcessGroup, interface: str | None) -> Peers:
    """Every rank of ``group`` (vLLM's PP group) runs ppsync's handler with
    these settings, or this rank refuses in one line (logged, then raised)
    before its token group is made (ppsync.compat.vllm.agreement)."""
    settings = plugin_settings()
    ranks = dist.get_process_group_ranks(group)
    me = dist.get_rank()
    mine = facts_here(settings, global_rank=me, pp_rank=ranks.index(me),
                      interface=str(interface), version=_ppsync_version())
    try:
        store = group.get_group_store()
    except RuntimeError:  # no store to agree in: the handshake alone checks
        return Peers({me: mine})
    try:
        return agree(store, mine, ranks, timeout_s=settings.timeout_s)
    except ConfigError as e:
        log.error("%s", e)
        raise


def _settings_kwargs() -> dict[str, Any]:
    """The handler's keywords from the operator's variables (read once)."""
    s = plugin_settings()
    return {"codec": s.codec, "carrier": s.carrier, "cpu_kernels": s.cpu_kernels,
            "device_kernels": s.device_kernels, "timeout_s": s.timeout_s,
            "silent_s": s.silent_s, "emulate": s.emulate}


class VllmPPHandler(PPHandler):
    """ppsync's handler, built with the arguments vLLM's GPU model runner
    passes its own, with vLLM's PP group (``get_pp_group().device_group``)
    and with the operator's settings (ppsync.compat.vllm.settings); the
    interface follows the installed vLLM's version."""

    def __init__(self, max_num_reqs: int, num_speculative_steps: int,
                 device: torch.device) -> None:
        # the default failure board lives in the token group's own store (the
        # world's), so a desync or a lost peer one rank sees reaches every rank
        group = _vllm_pp_group()
        self.peers = _agree(group, self.interface)
        super().__init__(max_num_reqs, num_speculative_steps, device,
                         group=group, **_settings_kwargs())
        _watch(self)


class VllmCpuPPHandler(PPHandler034Cpu):
    """The same for vLLM's standalone CPU runner, which passes
    ``max_num_reqs`` and ``device``."""

    def __init__(self, max_num_reqs: int, device: torch.device) -> None:
        group = _vllm_pp_group()
        self.peers = _agree(group, self.interface)
        super().__init__(max_num_reqs, device, group=group, **_settings_kwargs())
        _watch(self)


def _watch(handler: PPHandler) -> None:
    """A first or middle rank (PPSYNC_VLLM_ON_ERROR=exit): a failure its
    watcher finds while vLLM makes no handler call (a silent or lost peer,
    another rank's notice, while the worker idles in vLLM's RPC loop with
    receives posted) ends the worker, once, as an error in a call would."""
    if handler.is_last_rank or plugin_settings().on_error != "exit":
        return
    handler.token_path.watcher.on_failure = lambda err: _leave(handler, "its watcher", err)


EXIT_STATUS = 70
"""A worker's exit status when it leaves on an error (PPSYNC_VLLM_ON_ERROR=exit)."""
LEAVE_HOOKS: list[Callable[[str, BaseException], None]] = []
"""Called with (call, error) just before a worker leaves on an error (the
check's worker hooks record the error there)."""


def _leaving(call: Callable[..., Any]) -> Callable[..., Any]:
    """``call`` of a plugin-built handler: on a rank other than the last,
    an error ends the worker process (PPSYNC_VLLM_ON_ERROR=exit), since
    vLLM's executor reads results, errors included, only from the last PP
    rank's worker and would otherwise wait for ever; it does see a worker
    die, and then ends the engine."""

    @functools.wraps(call)
    def leaving(self: PPHandler, *args: Any, **kwargs: Any) -> Any:
        try:
            return call(self, *args, **kwargs)
        except Exception as e:
            if self.is_last_rank or plugin_settings().on_error != "exit":
                raise
            # once: the watcher may have acted on this failure already
            self.token_path.watcher.act_once(
                functools.partial(_leave, self, f"{call.__name__}()", e))
            raise

    return leaving


def leave_line(me: str, call: str, error: BaseException, named: str | None) -> str:
    """The one line a worker logs as it leaves on ``error``: who it is, the
    call, the error's type and first line, and the rank the error names
    with its host (``named``; ppsync.compat.vllm.agreement)."""
    first = (str(error).splitlines() or [""])[0]
    return (f"ppsync: {me}: {call} raised {type(error).__name__}: {first}"
            + ("" if named is None else f" [the rank named: {named}]")
            + f"; this worker exits (status {EXIT_STATUS}; {ENV_ON_ERROR}=exit) so that vLLM's "
            "executor, which hears errors from the last PP rank only, ends the engine")


def _leave(handler: PPHandler, call: str, error: BaseException) -> None:
    """Log ``error``, record and dump it (any error, not only ppsync's), and
    end the worker with EXIT_STATUS, its output (stdout too) flushed."""
    path = handler.token_path
    dump_on_error(path, error)
    peers: Peers = getattr(handler, "peers", Peers({}))
    me = peers.who(path.global_rank) or f"PP rank {path.rank} (global rank {path.global_rank})"
    log.error("%s", leave_line(me, call, error, peers.who(getattr(error, "peer", None))))
    for hook in LEAVE_HOOKS:
        with contextlib.suppress(Exception):
            hook(call, error)
    for handler_ in log.handlers:
        with contextlib.suppress(Exception):
            handler_.flush()
    _exit(EXIT_STATUS)


_exit: Callable[[int], None] = end_now  # a test puts a stand-in here

_bound: dict[str, type[PPHandler]] = {}


def vllm_handler_class(interface: str | None = None) -> type[PPHandler]:
    """The class the plugin binds for ``interface`` (None: the GPU runner's
    interface of the installed vLLM) built with vLLM's own arguments and PP
    group. One class per interface, made once."""
    name = resolve_interface(interface)
    if name not in _bound:
        base = handler_class(name)
        mixin = VllmCpuPPHandler if base.runner == "cpu" else VllmPPHandler
        _bound[name] = type(f"Vllm{base.__name__}", (mixin, base), {
            "__doc__": f"{base.__doc__} Built by vLLM's model runner (the plugin).",
            **{call: _leaving(getattr(base, call)) for call in HANDLER_CALLS}})
    return _bound[name]


def chosen_interfaces() -> dict[Runner, Interface] | None:
    """The interface per runner the plugin binds: ``PPSYNC_VLLM_INTERFACE``'s
    if set; else the installed vLLM's from the table (without vLLM's
    version: the GPU runner's :data:`DEFAULT_INTERFACE`). None, with a
    warning logged, for a vLLM newer than the table. ConfigError before
    0.23."""
    chosen = interfaces_from_env()
    if chosen is not None:
        return chosen
    version = installed_vllm_version()
    if version is None:
        return {"gpu": DEFAULT_INTERFACE}
    if newer_than_table(version):
        log.warning(
            "ppsync: vLLM %s is newer than the releases ppsync's interface table covers, so "
            "vLLM's own PPHandler stays in place; set %s to one of %s (or GPU,CPU: e.g. "
            "0.33,0.34-cpu) to serve it with that interface", version, ENV_INTERFACE,
            ", ".join(INTERFACES))
        return None
    chosen = {}
    for runner in MODULES:
        interface = interface_for_version(version, runner)
        if interface is not None:
            chosen[runner] = interface
    return chosen


def register() -> None:
    """vLLM's entry point: with ``PPSYNC_VLLM=1``, replace vLLM's PPHandler
    by ppsync's, in each runner the chosen interfaces are for; otherwise do
    nothing."""
    if os.environ.get(ENV_SWITCH) != "1":
        return
    # every process of the engine reads the same variables: a bad one fails
    # each of them here, before any handler is built
    settings = plugin_settings()
    if ensure_ray_copies():  # vLLM's older Ray executor drops PPSYNC_* otherwise
        log.info("ppsync: added %s to %s so that vLLM's Ray executor copies ppsync's settings "
                 "to its workers", PREFIX, RAY_PREFIXES_ENV)
    chosen = chosen_interfaces()  # chosen once, by the installed version or the variable
    if chosen is None:
        return
    for runner, interface in chosen.items():
        _bind(runner, vllm_handler_class(interface))
    if chosen and settings != _logged[0]:
        _logged[0] = settings
        log.info("ppsync: vLLM's handlers built with %s", settings.describe())


_logged: list[PluginSettings | None] = [None]


def _bind(runner: Runner, cls: type[PPHandler]) -> None:
    pp_utils_name, runner_name = MODULES[runner]
    try:
        pp_utils = importlib.import_module(pp_utils_name)
    except ImportError as e:
        if runner == "cpu":  # a vLLM built for another device: its CPU runner never runs
            log.info("ppsync: %s cannot be imported here (%s); vLLM's standalone CPU runner "
                     "keeps its own PPHandler", pp_utils_name, e)
            return
        raise ConfigError(f"{ENV_SWITCH}=1 but vLLM's {pp_utils_name} cannot be imported "
                          f"({e}); ppsync replaces the PPHandler of vLLM's Model Runner V2"
                          ) from None
    if not hasattr(pp_utils, _NAME):
        raise ConfigError(f"{ENV_SWITCH}=1 but {pp_utils_name} has no {_NAME} to replace "
                          "(a vLLM without Model Runner V2's PPHandler: before 0.23)")
    already = getattr(pp_utils, _NAME) is cls
    setattr(pp_utils, _NAME, cls)
    model_runner = sys.modules.get(runner_name)  # imported later: it binds ours from pp_utils
    if model_runner is not None and hasattr(model_runner, _NAME):
        setattr(model_runner, _NAME, cls)
    if not already:
        log.info("ppsync: vLLM's PPHandler in %s replaced by %s.%s (interface %s; %s=1)",
                 pp_utils_name, __name__, cls.__name__, cls.interface, ENV_SWITCH)
