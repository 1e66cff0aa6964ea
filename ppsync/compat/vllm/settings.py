"""What an operator sets for ppsync's vLLM handler: environment variables,
read and checked once, when the plugin loads (ppsync.compat.vllm.plugin).

vLLM loads the plugin in every one of its processes (the engine's and each
worker's) with the same environment, so a bad value fails every process at
start, each with the same one line naming the variable, the value and the
rule (:class:`ConfigError`), before any handler is built and before any
collective: an engine never runs with some workers on vLLM's handler and
others on ppsync's. The handlers the plugin binds are built with
:func:`plugin_settings` (read again only when the environment changed,
which a test does; vLLM does not); :func:`handler_path` builds the token
path they describe.

- ``PPSYNC_CODEC``: ``host`` | ``device`` (unset: the device codec on an
  accelerator, the host codec on CPU; with ``PPSYNC_EMULATE``: device);
- ``PPSYNC_CARRIER``: ``host`` | ``device``: how device frames travel
  (SyncConfig.carrier; unset: host, through pinned memory over gloo);
- ``PPSYNC_CPU_KERNELS``: ``auto`` | ``numba`` | ``numpy`` (SyncConfig.cpu_kernels);
- ``PPSYNC_DEVICE_KERNELS``: ``auto`` | ``triton`` | ``torch`` (SyncConfig.device_kernels);
- ``PPSYNC_TIMEOUT_S``, ``PPSYNC_SILENT_S``: the bound on one wait for a live
  peer, and how long a peer's heartbeat may stop before it is named silent
  (ppsync.compat.env, shared with the SGLang plugin);
- ``PPSYNC_EMULATE``: ``nccl`` | ``xccl``: the token group behaves as that
  backend's (the CPU twin, ppsync.core.wire.completion.twin): CPU only, refused
  in a process that sees a CUDA or XPU device, and only with the device codec;
- ``PPSYNC_DUMP_DIR``: where a failing rank writes its flight record
  (ppsync.core.recorder.registry); checked writable here;
- ``PPSYNC_VLLM_ON_ERROR``: ``exit`` (unset) | ``raise``: what a worker
  other than the last PP rank does when a handler call raises. vLLM's
  executor reads a step's result, and so hears of an error, only from the
  last PP rank's worker: an error raised on another rank is logged there and
  the engine waits for ever. With ``exit`` that worker logs the error and
  exits (status 70), so vLLM's executor sees a worker die and ends the
  engine, and such a worker's watcher thread acts the same way on a failure
  it finds while vLLM makes no call (a silent or lost peer);
  ``raise`` leaves it as vLLM's own handler does.

An empty value counts as unset.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, cast, get_args

import torch
import torch.distributed as dist

from ppsync.compat.env import BOUND_VARS, ENV_SILENT, ENV_TIMEOUT, bounds_from_env
from ppsync.core.codec import check_frames, frames_home
from ppsync.core.codec.cpu_kernels import resolve_cpu_kernels
from ppsync.core.codec.device_kernels import resolve_device_kernels
from ppsync.core.path.names import CallNames
from ppsync.core.path.token_path import TokenPath
from ppsync.core.recorder.registry import check_dump_dir
from ppsync.core.wire.backends import CARRIERS
from ppsync.core.wire.board import FailureBoard
from ppsync.core.wire.completion import EMULATED, HostCompleted, StreamOrdered
from ppsync.core.wire.completion import emulate as emulate_group
from ppsync.core.wire.groups import strided_groups, token_group_among
from ppsync.core.wire.platform import platform_for
from ppsync.errors import ConfigError
from ppsync.schemas.config import (
    DEFAULT_SILENT_S,
    DEFAULT_TIMEOUT_S,
    CarrierName,
    CodecName,
    CpuKernelsName,
    DeviceKernelsName,
    EmulatedName,
    SyncConfig,
)
from ppsync.schemas.dump import DUMP_DIR_ENV

__all__ = ["ENV_CARRIER", "ENV_CODEC", "ENV_CPU_KERNELS", "ENV_DEVICE_KERNELS", "ENV_EMULATE",
           "ENV_ON_ERROR", "ENV_SILENT", "ENV_TIMEOUT", "RENAMED_ENV",
           "SETTINGS_ENV", "PluginSettings", "accelerator_here", "check_twin", "handler_path",
           "plugin_settings", "settings_from_env"]

ENV_CODEC = "PPSYNC_CODEC"
ENV_CPU_KERNELS = "PPSYNC_CPU_KERNELS"
ENV_DEVICE_KERNELS = "PPSYNC_DEVICE_KERNELS"
ENV_CARRIER = "PPSYNC_CARRIER"
ENV_EMULATE = "PPSYNC_EMULATE"
ENV_ON_ERROR = "PPSYNC_VLLM_ON_ERROR"
RENAMED_ENV = {"PPSYNC_HOST_KERNELS": ENV_CPU_KERNELS}
"""Old names of variables, each refused naming its new one: no alias, as no
release has shipped under the old name."""
SETTINGS_ENV = (ENV_CODEC, ENV_CARRIER, ENV_CPU_KERNELS, ENV_DEVICE_KERNELS, *BOUND_VARS,
                ENV_EMULATE, DUMP_DIR_ENV, ENV_ON_ERROR, *RENAMED_ENV)
"""Every variable this module reads."""

CODECS: tuple[str, ...] = get_args(CodecName)
CPU_KERNELS: tuple[str, ...] = get_args(CpuKernelsName)
DEVICE_KERNELS: tuple[str, ...] = get_args(DeviceKernelsName)


@dataclass(frozen=True)
class PluginSettings:
    """The handler's settings, as the operator's variables give them."""

    codec: CodecName | None = None  # None: by the device (default_codec)
    carrier: CarrierName = "host"  # how device frames travel
    cpu_kernels: CpuKernelsName = "auto"
    device_kernels: DeviceKernelsName = "auto"
    timeout_s: float = DEFAULT_TIMEOUT_S
    silent_s: float = DEFAULT_SILENT_S
    emulate: EmulatedName | None = None  # the CPU twin of that backend
    dump_dir: Path | None = None
    on_error: Literal["exit", "raise"] = "exit"  # a worker other than the last PP rank's

    def describe(self) -> str:
        """One line for the log: what the plugin's handlers are built with."""
        return (f"codec {self.codec or 'by device'}, carrier {self.carrier}, CPU kernels "
                f"{self.cpu_kernels}, device "
                f"kernels {self.device_kernels}, timeout {self.timeout_s:g} s, silent after "
                f"{self.silent_s:g} s, semantics "
                f"{'twin of ' + self.emulate if self.emulate else 'the backend'}s, dumps "
                f"{self.dump_dir or 'off'}, on an error off the last rank: {self.on_error}")


def _one_of(env: Mapping[str, str], name: str, choices: tuple[str, ...]) -> str | None:
    value = env.get(name, "").strip()
    if not value:
        return None
    if value not in choices:
        raise ConfigError(f"{name} = {value!r} must be one of {', '.join(choices)}")
    return value


def accelerator_here() -> str | None:
    """The accelerator this process sees ("cuda", "xpu"), or None."""
    for kind in ("cuda", "xpu"):
        mod = getattr(torch, kind, None)
        if mod is not None and mod.is_available():
            return kind
    return None


def settings_from_env(env: Mapping[str, str] | None = None,
                      accelerator: Callable[[], str | None] = accelerator_here
                      ) -> PluginSettings:
    """The settings ``env`` (None: this process's environment) gives;
    :class:`ConfigError` with one line naming the first bad variable, its
    value and the rule. ``accelerator``: which accelerator this process sees
    (PPSYNC_EMULATE is refused where there is one)."""
    env = os.environ if env is None else env
    for old, new in RENAMED_ENV.items():
        if env.get(old, "").strip():
            raise ConfigError(f"{old} is now {new}")
    codec = _one_of(env, ENV_CODEC, CODECS)
    carrier = _one_of(env, ENV_CARRIER, tuple(c.name for c in CARRIERS)) or "host"
    cpu_kernels = _one_of(env, ENV_CPU_KERNELS, CPU_KERNELS) or "auto"
    device_kernels = _one_of(env, ENV_DEVICE_KERNELS, DEVICE_KERNELS) or "auto"
    bounds = bounds_from_env(env)
    emulate = _one_of(env, ENV_EMULATE, EMULATED)
    if emulate is not None:
        if codec == "host":
            raise ConfigError(f"{ENV_EMULATE} = {emulate!r} needs the device codec ({emulate} "
                              f"carries device tensors only): {ENV_CODEC} = 'host'; set it to "
                              "device or unset it")
        seen = accelerator()
        if seen is not None:
            raise ConfigError(f"{ENV_EMULATE} = {emulate!r} runs the CPU twin of {emulate}, "
                              f"CPU only: this process sees a {seen} device (there the real "
                              "backend runs): unset it")
        codec = "device"
    _kernels_load(cpu_kernels, device_kernels, codec, accelerator)
    on_error = _one_of(env, ENV_ON_ERROR, ("exit", "raise")) or "exit"
    dump = env.get(DUMP_DIR_ENV, "").strip()
    dump_dir = Path(dump) if dump else None
    if dump_dir is not None:
        check_dump_dir(dump_dir, DUMP_DIR_ENV)
    return PluginSettings(
        codec=cast(CodecName | None, codec),
        carrier=cast(CarrierName, carrier),
        cpu_kernels=cast(CpuKernelsName, cpu_kernels),
        device_kernels=cast(DeviceKernelsName, device_kernels),
        timeout_s=bounds.timeout_s, silent_s=bounds.silent_s,
        emulate=cast(EmulatedName | None, emulate),
        dump_dir=dump_dir, on_error=cast(Literal["exit", "raise"], on_error))


def _kernels_load(host: str, device: str, codec: str | None,
                  accelerator: Callable[[], str | None]) -> None:
    """A kernel set named outright must load here (as the CLI checks its
    flags): ConfigError naming the variable, not a failure in the first
    handler."""
    config = SyncConfig(pp_size=1, max_num_reqs=1, cpu_kernels=host,  # type: ignore[arg-type]
                        device_kernels=device)  # type: ignore[arg-type]
    checks: list[tuple[str, str, Callable[[], str]]] = [
        (ENV_CPU_KERNELS, host, lambda: resolve_cpu_kernels(config))]
    if codec != "host":
        seen = torch.device(accelerator() or "cpu")
        checks.append((ENV_DEVICE_KERNELS, device,
                       lambda: resolve_device_kernels(config, seen)))
    for name, value, resolve in checks:
        if value == "auto":
            continue
        try:
            resolve()
        except ConfigError as e:
            raise ConfigError(f"{name} = {value!r}: {e}") from None


def check_twin(config: SyncConfig, emulate: str, device: torch.device) -> None:
    """ConfigError unless a handler on ``device`` with ``config`` can run
    on the CPU twin of ``emulate`` (before any group is made)."""
    if device.type != "cpu":
        raise ConfigError(f"emulate = {emulate!r} runs the CPU twin on CPU tensors; device = "
                          f"{device} (on a GPU the real backend runs)")
    carried = StreamOrdered(emulate) if config.carrier == "device" else HostCompleted()
    check_frames(config, carried, f"gloo emulating {emulate}")


def handler_path(config: SyncConfig, device: torch.device, pp_group: dist.ProcessGroup,
                 pp_groups: Sequence[Sequence[int]] | None,
                 board: FailureBoard | Literal["group"] | None, emulate: str | None,
                 names: CallNames) -> TokenPath:
    """A handler's token path: its token group made among ``pp_groups``
    (None: vLLM's, strided) on the backend its frames take. The device
    codec's frames live on the engine's device and travel by their carrier
    (gloo through pinned memory, or the device's backend: nccl on CUDA,
    xccl on XPU); host frames go over gloo. With ``emulate``, its twin."""
    if emulate is not None:  # before any group is made
        check_twin(config, emulate, device)
    backend, platform = frames_home(config.codec, config.carrier, platform_for(device))
    if pp_groups is None:
        pp_groups = strided_groups(dist.get_world_size(), dist.get_process_group_ranks(pp_group))
    tokens = token_group_among(pp_group, pp_groups, timeout_s=config.timeout_s, backend=backend)
    if emulate is not None:  # the same completion choice as every path's
        emulate_group(tokens, emulate, carrier=config.carrier)
    return TokenPath(config, tokens, board=board, names=names, platform=platform)


_read: tuple[tuple[str, ...], PluginSettings] | None = None


def plugin_settings() -> PluginSettings:
    """This process's settings, read once (again only if a variable changed)."""
    global _read
    key = tuple(os.environ.get(name, "") for name in SETTINGS_ENV)
    if _read is None or _read[0] != key:
        _read = (key, settings_from_env())
    return _read[1]
