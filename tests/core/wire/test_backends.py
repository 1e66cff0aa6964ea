"""ppsync.core.wire.backends: each backend and carrier is declared once,
and every list of names the rest of ppsync offers (the flags, the plugin's
settings, the schemas' literals, the platforms, the completions) agrees
with the declaration: a new backend or carrier that one of them misses
fails here."""

from __future__ import annotations

from typing import get_args

import pytest

from ppsync.compat.vllm.settings import settings_from_env
from ppsync.core.codec.carriers import CARRIER_CLASSES
from ppsync.core.wire.backends import (
    BACKENDS,
    CARRIERS,
    backend,
    carried_by,
    device_backend,
    twin_names,
)
from ppsync.core.wire.completion import EMULATED
from ppsync.core.wire.completion.semantics import HostCompleted, StreamOrdered
from ppsync.core.wire.platform import _BY_NAME, PLATFORMS
from ppsync.errors import ConfigError
from ppsync.schemas.config import CarrierName, EmulatedName


def test_the_schemas_literals_are_the_declarations_names() -> None:
    assert set(get_args(EmulatedName)) == set(twin_names()) == set(EMULATED)
    assert set(get_args(CarrierName)) == {c.name for c in CARRIERS} == set(CARRIER_CLASSES)


def test_every_backend_has_its_platform_and_completion() -> None:
    assert set(PLATFORMS) == {b.device_type for b in BACKENDS} == set(_BY_NAME)
    for b in BACKENDS:
        assert _BY_NAME[b.device_type].name == b.device_type
        assert device_backend(b.device_type) is b
        if b.stream_ordered:
            assert StreamOrdered(b.name).can_abort == b.abortable
        else:
            assert not HostCompleted.stream_ordered


def test_device_frames_go_by_their_carrier() -> None:
    assert [carried_by("host", b.device_type) for b in BACKENDS] == ["gloo"] * len(BACKENDS)
    assert [carried_by("device", b.device_type) for b in BACKENDS] == [b.name for b in BACKENDS]
    with pytest.raises(ConfigError, match=r"backend 'hccl' must be one of gloo, nccl, xccl"):
        backend("hccl")


def test_the_plugins_setting_offers_every_carrier() -> None:
    for c in CARRIERS:
        got = settings_from_env({"PPSYNC_CARRIER": c.name}, accelerator=lambda: None)
        assert got.carrier == c.name
    with pytest.raises(ConfigError, match=r"PPSYNC_CARRIER = 'nvlink' must be one of host, device"):
        settings_from_env({"PPSYNC_CARRIER": "nvlink"}, accelerator=lambda: None)
