"""Rule 7 of docs/design.md: relay named aux hidden states (EAGLE3-style drafters)
from the upstream stage to the next one, unchanged."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TypeVar

import torch

from ppsync.compat.vllm.arg_checks import rebuilt_like
from ppsync.compat.vllm.versions import relay_keys_of
from ppsync.errors import BatchError, ConfigError

T = TypeVar("T")


def _tensors(obj: object, name: str) -> Mapping[str, torch.Tensor]:
    """A mapping, or an object carrying one as ``.tensors`` (vLLM's
    IntermediateTensors)."""
    if isinstance(obj, Mapping):
        return obj
    inner = getattr(obj, "tensors", None)
    if isinstance(inner, Mapping):
        return inner
    raise BatchError(f"{name} of type {type(obj).__name__} is neither a mapping nor has .tensors")


class AuxRelay:
    """The configured keys, and the relay itself."""

    def __init__(self) -> None:
        self.keys: tuple[str, ...] = ()

    def configure(self, keys: Sequence[str]) -> None:
        """Relay ``keys`` from now on (an empty sequence turns relaying off)."""
        if isinstance(keys, str) or not isinstance(keys, Sequence):
            raise ConfigError(f"keys = {keys!r} must be a sequence of names (not one string)")
        for k in keys:
            if not isinstance(k, str) or not k:
                raise ConfigError(f"aux hidden-state key {k!r} must be a non-empty str")
        if len(set(keys)) != len(keys):
            raise ConfigError(f"aux hidden-state keys {list(keys)} name a key twice")
        self.keys = tuple(keys)

    def relay(self, upstream: object | None, output: object) -> Mapping[str, torch.Tensor]:
        """``output`` plus the configured keys taken from ``upstream``."""
        out = _tensors(output, "output_intermediate_tensors")
        if not self.keys:
            return out
        if upstream is None:
            raise BatchError(
                f"aux hidden-state keys {list(self.keys)} are configured but no upstream "
                "intermediate_tensors were given (first stage?)"
            )
        up = _tensors(upstream, "intermediate_tensors")
        merged = dict(out)
        for k in self.keys:
            if k not in up:
                raise BatchError(
                    f"aux hidden-state key {k!r} missing from the upstream intermediate "
                    f"tensors (have {sorted(up)})"
                )
            merged[k] = up[k]
        return merged


class AuxRelayCalls:
    """The handler's calls for the relay (a base of ppsync.compat.vllm.handler.PPHandler)."""

    _aux: AuxRelay

    def configure_aux_hidden_state_relay(self, model: torch.nn.Module | Sequence[str]) -> None:
        """Relay the named intermediate tensors from the upstream stage to
        the next: given vLLM's model, the keys vLLM's EAGLE3 helper names for
        it on this rank; or the keys themselves (empty: relaying off)."""
        keys = relay_keys_of(model) if isinstance(model, torch.nn.Module) else model
        self._aux.configure(keys)

    def relay_aux_hidden_states(
        self, intermediate_tensors: object | None, output_intermediate_tensors: T
    ) -> T:
        """``output_intermediate_tensors`` plus the configured keys taken from
        ``intermediate_tensors``, as the type it was given (a mapping, or an
        object with ``.tensors`` such as vLLM's IntermediateTensors, rebuilt).
        The output itself when no keys are configured; :class:`BatchError`
        naming the key when one is missing upstream or there is no upstream."""
        merged = self._aux.relay(intermediate_tensors, output_intermediate_tensors)
        if not self._aux.keys:
            return output_intermediate_tensors
        return rebuilt_like(output_intermediate_tensors, merged)
