"""Rule 7 of docs/design.md: AuxRelay."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import pytest
import torch

from ppsync.compat.vllm.aux_relay import AuxRelay
from ppsync.errors import BatchError, ConfigError


@dataclass
class IntermediateTensors:
    """Like vLLM's IntermediateTensors: a mapping held as ``.tensors``."""

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)


def _relay(*keys: str) -> AuxRelay:
    relay = AuxRelay()
    relay.configure(keys)
    return relay


def _hidden(value: float) -> torch.Tensor:
    return torch.full((2, 4), value)


def test_new_relay_has_no_keys() -> None:
    assert AuxRelay().keys == ()


def test_no_keys_returns_output_unchanged() -> None:
    output = {"hidden_states": _hidden(1.0)}
    upstream = {"aux_0": _hidden(2.0)}
    assert AuxRelay().relay(upstream, output) is output
    assert AuxRelay().relay(None, output) is output
    assert set(output) == {"hidden_states"}


def test_no_keys_unwraps_tensors_attribute() -> None:
    output = IntermediateTensors({"hidden_states": _hidden(1.0)})
    assert AuxRelay().relay(None, output) is output.tensors


def test_keys_are_copied_from_upstream() -> None:
    aux0, aux1, hidden = _hidden(2.0), _hidden(3.0), _hidden(1.0)
    upstream = {"aux_0": aux0, "aux_1": aux1, "residual": _hidden(9.0)}
    output = {"hidden_states": hidden}
    merged = _relay("aux_0", "aux_1").relay(upstream, output)
    assert set(merged) == {"hidden_states", "aux_0", "aux_1"}
    # relayed unchanged: the very same tensors, not copies
    assert merged["aux_0"] is aux0
    assert merged["aux_1"] is aux1
    assert merged["hidden_states"] is hidden
    # the caller's output mapping is not modified
    assert set(output) == {"hidden_states"}


def test_upstream_value_wins_over_output_for_a_relayed_key() -> None:
    upstream = {"aux_0": _hidden(2.0)}
    merged = _relay("aux_0").relay(upstream, {"aux_0": _hidden(5.0)})
    assert merged["aux_0"] is upstream["aux_0"]


def test_objects_with_tensors_mapping_are_accepted() -> None:
    aux = _hidden(2.0)
    upstream = IntermediateTensors({"aux_0": aux})
    output = IntermediateTensors({"hidden_states": _hidden(1.0)})
    merged = _relay("aux_0").relay(upstream, output)
    assert isinstance(merged, Mapping)
    assert merged["aux_0"] is aux
    assert set(merged) == {"hidden_states", "aux_0"}
    assert set(output.tensors) == {"hidden_states"}


def test_missing_key_names_the_key_and_what_upstream_has() -> None:
    upstream = {"residual": _hidden(1.0), "aux_0": _hidden(2.0)}
    with pytest.raises(
        BatchError,
        match=r"aux hidden-state key 'aux_1' missing from the upstream intermediate tensors "
        r"\(have \['aux_0', 'residual'\]\)",
    ):
        _relay("aux_0", "aux_1").relay(upstream, {})


def test_keys_but_no_upstream() -> None:
    with pytest.raises(
        BatchError,
        match=r"aux hidden-state keys \['aux_0'\] are configured but no upstream "
        r"intermediate_tensors were given",
    ):
        _relay("aux_0").relay(None, {"hidden_states": _hidden(1.0)})


def test_output_of_the_wrong_type() -> None:
    with pytest.raises(
        BatchError,
        match=r"output_intermediate_tensors of type list is neither a mapping nor has \.tensors",
    ):
        AuxRelay().relay(None, [_hidden(1.0)])


def test_upstream_of_the_wrong_type() -> None:
    with pytest.raises(
        BatchError,
        match=r"intermediate_tensors of type Tensor is neither a mapping nor has \.tensors",
    ):
        _relay("aux_0").relay(_hidden(1.0), {})


def test_tensors_attribute_that_is_not_a_mapping_is_rejected() -> None:
    @dataclass
    class Wrong:
        tensors: list[torch.Tensor]

    with pytest.raises(BatchError, match=r"of type Wrong is neither a mapping nor has \.tensors"):
        AuxRelay().relay(None, Wrong([_hidden(1.0)]))


def test_configure_accepts_any_sequence_and_empty_turns_off() -> None:
    relay = AuxRelay()
    relay.configure(["aux_0", "aux_1"])
    assert relay.keys == ("aux_0", "aux_1")
    relay.configure(())
    assert len(relay.keys) == 0
    output = {"hidden_states": _hidden(1.0)}
    assert relay.relay(None, output) is output


def test_configure_rejects_a_single_string() -> None:
    relay = AuxRelay()
    with pytest.raises(
        ConfigError, match=r"keys = 'aux_0' must be a sequence of names \(not one string\)"
    ):
        relay.configure("aux_0")
    assert relay.keys == ()


@pytest.mark.parametrize(("bad", "shown"), [("", "''"), (3, "3"), (None, "None")])
def test_configure_rejects_bad_key(bad: object, shown: str) -> None:
    relay = _relay("kept")
    with pytest.raises(
        ConfigError, match=rf"aux hidden-state key {shown} must be a non-empty str"
    ):
        relay.configure(["aux_0", bad])  # type: ignore[list-item]
    assert relay.keys == ("kept",)


def test_configure_rejects_duplicate_keys() -> None:
    relay = AuxRelay()
    with pytest.raises(
        ConfigError, match=r"aux hidden-state keys \['aux_0', 'aux_0'\] name a key twice"
    ):
        relay.configure(["aux_0", "aux_0"])
    assert relay.keys == ()
