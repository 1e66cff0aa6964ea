"""Rule 7 of docs/design.md: relay named aux hidden states (EAGLE3-style drafters)
from the upstream stage to the next one, unchanged."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from ppsync.errors import BatchError, ConfigError


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
