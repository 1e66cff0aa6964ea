"""ppsync.schemas.config: SyncConfig.build, its defaults and its rules."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from ppsync.errors import ConfigError, PPSyncError
from ppsync.schemas.config import SyncConfig


def test_defaults() -> None:
    cfg = SyncConfig.build(pp_size=4, max_num_reqs=16)
    assert cfg.pp_size == 4
    assert cfg.max_num_reqs == 16
    assert cfg.num_speculative_steps == 0
    assert cfg.ring_depth is None
    assert cfg.timeout_s == 300.0  # of the order of vLLM's execute-model timeout
    assert cfg.silent_s == 15.0
    assert cfg.max_pending_s == 86400.0
    assert cfg.wire == "fixed"


def test_the_cap_on_a_pending_transfer_allows_a_whole_wait() -> None:
    with pytest.raises(ConfigError, match=r"max_pending_s = 10 is below timeout_s = 20; a "
                                          r"transfer's cap must allow a whole wait"):
        SyncConfig.build(pp_size=2, max_num_reqs=4, timeout_s=20.0, max_pending_s=10.0)


def test_depth_defaults_to_pp_size() -> None:
    assert SyncConfig.build(pp_size=4, max_num_reqs=16).depth == 4
    assert SyncConfig.build(pp_size=1, max_num_reqs=16).depth == 1


@pytest.mark.parametrize("ring_depth", [1, 2, 4])
def test_explicit_ring_depth_is_in_force(ring_depth: int) -> None:
    cfg = SyncConfig.build(pp_size=4, max_num_reqs=16, ring_depth=ring_depth)
    assert cfg.ring_depth == ring_depth
    assert cfg.depth == ring_depth


@pytest.mark.parametrize(("k", "width"), [(0, 1), (1, 2), (3, 4), (64, 65)])
def test_sample_width_is_k_plus_one(k: int, width: int) -> None:
    cfg = SyncConfig.build(pp_size=2, max_num_reqs=8, num_speculative_steps=k)
    assert cfg.sample_width == width


def test_exact_wire_mode() -> None:
    assert SyncConfig.build(pp_size=2, max_num_reqs=8, wire="exact").wire == "exact"


def test_boundaries_accepted() -> None:
    cfg = SyncConfig.build(
        pp_size=1024, max_num_reqs=1 << 20, num_speculative_steps=64, ring_depth=1024,
        timeout_s=86400,
    )
    assert cfg.depth == 1024
    assert cfg.timeout_s == 86400.0


def test_ring_depth_above_pp_size_names_ring_depth() -> None:
    with pytest.raises(ConfigError, match=r"ring_depth = 5 exceeds pp_size = 4") as info:
        SyncConfig.build(pp_size=4, max_num_reqs=8, ring_depth=5)
    assert isinstance(info.value, PPSyncError)
    assert isinstance(info.value, ValueError)
    # pydantic's own exception never leaks through build()
    assert not isinstance(info.value, ValidationError)


def test_extra_field_is_forbidden() -> None:
    with pytest.raises(ConfigError, match=r"bogus = 1: Extra inputs are not permitted"):
        SyncConfig.build(pp_size=2, max_num_reqs=8, bogus=1)


def test_the_old_name_of_cpu_kernels_is_refused_naming_the_new() -> None:
    with pytest.raises(ConfigError, match=r"^invalid SyncConfig: host_kernels is now cpu_kernels$"):
        SyncConfig.build(pp_size=2, max_num_reqs=8, host_kernels="numpy")
    with pytest.raises(ValidationError, match=r"host_kernels is now cpu_kernels"):
        SyncConfig(pp_size=2, max_num_reqs=8, host_kernels="numpy")  # type: ignore[call-arg]


def test_missing_required_field_is_named() -> None:
    with pytest.raises(ConfigError, match=r"max_num_reqs: required, not given"):
        SyncConfig.build(pp_size=2)


@pytest.mark.parametrize(
    ("fields", "pattern"),
    [
        ({"pp_size": 0}, r"pp_size = 0: .*greater than or equal to 1"),
        ({"pp_size": 1025}, r"pp_size = 1025: .*less than or equal to 1024"),
        ({"pp_size": 2.5}, r"pp_size = 2\.5: .*valid integer"),
        ({"pp_size": "two"}, r"pp_size = 'two': .*valid integer"),
        ({"max_num_reqs": 0}, r"max_num_reqs = 0: .*greater than or equal to 1"),
        ({"max_num_reqs": (1 << 20) + 1}, r"max_num_reqs = 1048577: .*less than or equal"),
        ({"num_speculative_steps": -1}, r"num_speculative_steps = -1: .*greater than or equal"),
        ({"num_speculative_steps": 65}, r"num_speculative_steps = 65: .*less than or equal"),
        ({"ring_depth": 0}, r"ring_depth = 0: .*greater than or equal to 1"),
        ({"timeout_s": 0}, r"timeout_s = 0: .*greater than 0"),
        ({"timeout_s": -1.5}, r"timeout_s = -1\.5: .*greater than 0"),
        ({"timeout_s": float("inf")}, r"timeout_s = inf: .*less than or equal to 86400"),
        ({"timeout_s": float("nan")}, r"timeout_s = nan"),
        ({"wire": "loose"}, r"wire = 'loose': .*'fixed' or 'exact'"),
    ],
)
def test_bad_values_raise_config_error_naming_field_and_value(
    fields: dict[str, object], pattern: str
) -> None:
    kwargs: dict[str, object] = {"pp_size": 2, "max_num_reqs": 8, **fields}
    with pytest.raises(ConfigError, match=pattern):
        SyncConfig.build(**kwargs)


def test_every_bad_field_is_reported_at_once() -> None:
    with pytest.raises(ConfigError) as info:
        SyncConfig.build(pp_size=0, max_num_reqs=0)
    msg = str(info.value)
    assert "pp_size = 0" in msg
    assert "max_num_reqs = 0" in msg


def test_config_is_frozen() -> None:
    cfg = SyncConfig.build(pp_size=2, max_num_reqs=8)
    with pytest.raises(ValidationError, match="frozen"):
        cfg.pp_size = 3
    assert cfg.pp_size == 2


def test_equal_fields_give_equal_configs() -> None:
    a = SyncConfig.build(pp_size=2, max_num_reqs=8, num_speculative_steps=2)
    b = SyncConfig.build(num_speculative_steps=2, max_num_reqs=8, pp_size=2)
    assert a == b
    assert a != SyncConfig.build(pp_size=2, max_num_reqs=8, num_speculative_steps=3)


@pytest.mark.parametrize("value", [True, "4", 2.0])
def test_pp_size_is_strictly_an_int(value: object) -> None:
    with pytest.raises(ConfigError, match=r"pp_size = .*valid integer"):
        SyncConfig.build(pp_size=value, max_num_reqs=4)
