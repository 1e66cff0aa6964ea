"""The codec: packs a token path's steps into frames, checks them and hands
them out (the frame format itself is ppsync.core.frame).

- ``base``: the protocol a token path and the vLLM adapter call
  (``StepCodec``), its types, and the rules for where frames live;
- ``host``: frames in numpy on the host (``HostCodec``);
- ``device``: frames in torch ops where the engine's tensors live
  (``DeviceCodec``);
- :func:`codec_for` (here): the one place the choice is made.
"""

from __future__ import annotations

from ppsync.core.codec.device import DeviceCodec
from ppsync.core.codec.host import HostCodec
from ppsync.core.codec.protocol import (
    Issue,
    StepCodec,
    StepDrafts,
    Wait,
    check_frames,
    default_codec,
    frames_home,
)
from ppsync.core.wire.completion import Completion
from ppsync.core.wire.platform import Platform
from ppsync.schemas.config import SyncConfig, frames_on_device

__all__ = [
    "DeviceCodec",
    "HostCodec",
    "Issue",
    "StepCodec",
    "StepDrafts",
    "Wait",
    "check_frames",
    "codec_for",
    "default_codec",
    "frames_home",
    "frames_on_device",
]


def codec_for(config: SyncConfig, platform: Platform, *, completion: Completion,
              backend: str, rank: int, src: int) -> StepCodec:
    """The codec ``config.codec`` names: the one place the choice is made.
    ``completion``: the token group's semantics (``backend``: its name)."""
    check_frames(config, completion, backend)
    if frames_on_device(config.codec):
        return DeviceCodec(config, platform, completion=completion, rank=rank, src=src)
    return HostCodec(config)
