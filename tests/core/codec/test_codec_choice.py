"""ppsync.core.codec.protocol: the one choice of a codec, and the rules both
codecs share, checked through each (the device codec on CPU tensors)."""

from __future__ import annotations

from typing import get_args

import numpy as np
import pytest
import torch

from ppsync.cli.parser import parse
from ppsync.core import SampledStep
from ppsync.core.codec import DeviceCodec, HostCodec, StepCodec, codec_for, default_codec
from ppsync.core.rules import BatchView, batch_facts
from ppsync.core.wire.completion import HostCompleted, StreamOrdered
from ppsync.core.wire.platform import platform_for
from ppsync.errors import BatchError, ConfigError
from ppsync.schemas.config import CodecName, SyncConfig, frames_on_device

K = 2
CPU = torch.device("cpu")


def _config(codec: str, wire: str = "fixed", carrier: str = "device") -> SyncConfig:
    return SyncConfig.build(pp_size=2, max_num_reqs=8, num_speculative_steps=K,
                            codec=codec, wire=wire, carrier=carrier)


def _codec(codec: str) -> StepCodec:
    return codec_for(_config(codec), platform_for(CPU), completion=HostCompleted(),
                     backend="gloo", rank=1, src=1)


def _view(n: int) -> BatchView:
    return BatchView(n, np.arange(n, dtype=np.int64), np.full(n, 20, dtype=np.int64),
                     np.ones(n, dtype=np.int64), np.full(n, 16, dtype=np.int64))


def test_the_config_chooses_the_codec_and_callers_ask_the_object() -> None:
    host, device = _codec("host"), _codec("device")
    assert isinstance(host, HostCodec) and not host.on_device and host.device == CPU
    assert isinstance(device, DeviceCodec) and device.on_device and device.device == CPU


@pytest.mark.parametrize("backend", ["nccl", "xccl"])
def test_the_host_codec_on_a_device_only_backend_is_a_config_error(backend: str) -> None:
    with pytest.raises(ConfigError, match=rf"codec = 'host' frames are host buffers; the "
                       rf"token group \({backend}, stream-ordered\) takes device tensors only"):
        codec_for(_config("host"), platform_for(CPU), completion=StreamOrdered(),
                  backend=backend, rank=0, src=1)


@pytest.mark.parametrize("backend", ["nccl", "xccl"])
def test_the_host_carrier_on_a_device_only_backend_is_a_config_error(backend: str) -> None:
    # its frames go over gloo from pinned memory: NCCL would take them as
    # device pointers; refused before anything is built
    with pytest.raises(ConfigError, match=rf"carrier = 'host' sends frames over gloo from "
                       rf"pinned host memory; the token group \({backend}, stream-ordered\) "
                       r"takes device tensors only"):
        codec_for(_config("device", carrier="host"), platform_for(CPU),
                  completion=StreamOrdered(), backend=backend, rank=0, src=1)


def test_exact_wire_on_a_stream_ordered_group_is_a_config_error() -> None:
    # on NCCL a size that differs between ranks is undefined behaviour, not
    # gloo's error: refused before anything is built
    with pytest.raises(ConfigError, match=r"wire = 'exact' sizes each frame by its step; on "
                       r"a stream-ordered group \(nccl\) .* use wire = 'fixed'"):
        codec_for(_config("device", "exact"), platform_for(CPU), completion=StreamOrdered(),
                  backend="nccl", rank=0, src=1)
    codec_for(_config("device", "exact"), platform_for(CPU), completion=HostCompleted(),
              backend="gloo", rank=0, src=1)  # gloo: sizes are checked by the header


@pytest.mark.parametrize(
    ("width", "sample_width", "match"),
    [
        (3, 2, r"sampled_token_ids.shape\[1\] = 3 exceeds the step's sample width 2"),
        (4, None, r"sampled_token_ids.shape\[1\] = 4 must lie in \[1, L = 3\]"),
    ],
)
def test_both_codecs_apply_one_width_rule(width: int, sample_width: int | None,
                                          match: str) -> None:
    n = 3
    view = _view(n)
    for name in ("host", "device"):
        codec = _codec(name)
        with pytest.raises(BatchError, match=match):
            codec.prepare(view, batch_facts(view, 8), SampledStep(
                torch.zeros((n, width), dtype=torch.int64), torch.ones(n, dtype=torch.int32),
                torch.zeros(n, dtype=torch.int32), None, sample_width))


def test_the_codec_default_is_decided_in_one_place() -> None:
    # SyncConfig's default, the command's flags and an engine that names no
    # codec (default_codec) agree: the CPU gets SyncConfig's codec
    config = SyncConfig(pp_size=2, max_num_reqs=1)
    assert default_codec(torch.device("cpu")) == config.codec == "host"
    assert default_codec(torch.device("cpu"), emulated=True) == "device"
    assert default_codec(torch.device("meta")) == "device"  # any accelerator's
    for argv in (["launch", "--pp-size", "2"], ["run"]):
        args = parse(argv)
        for field in ("codec", "carrier", "cpu_kernels", "device_kernels", "wire"):
            assert getattr(args, field) == getattr(config, field), (argv[0], field)


def test_each_codec_object_says_where_its_frames_live_as_the_one_rule_does() -> None:
    # frames_on_device decides it before a codec exists (the group's backend,
    # the command's flags); the codec codec_for builds must agree
    for name in get_args(CodecName):
        assert _codec(name).on_device is frames_on_device(name), name
