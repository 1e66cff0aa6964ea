"""Synchronous core (torch + numpy), one concern per package:

- ``rules``: a step's batch view, its need-sampled mask, facts and checks;
- ``frame``: the frame format (its layout, frames in numpy and on a device);
- ``codec``: packs a step into frames and releases them (host: numpy; device:
  torch ops), with its CPU and device kernel sets and the step records;
- ``wire``: platforms (cpu, cuda, xpu), the token groups and their transport,
  what a group's works mean (completion, the CPU twin), bounded waits, the
  failure board, teardown, the torch range;
- ``recorder``: the flight recorder and its dumps;
- ``path``: the token path that combines them (generations, ring, handshake,
  the group end, failures)."""

# isort: off
# first: an unsupported torch is refused before anything binds to it
from ppsync.core.wire.torch_support import TORCH_OLDEST  # noqa: F401
# isort: on
from ppsync.core.codec import StepCodec
from ppsync.core.codec.released import ReleasedStep
from ppsync.core.codec.steps import PendingStep, PreparedStep
from ppsync.core.frame import FrameView, SampledStep
from ppsync.core.frame.device_frames import DeviceFrames
from ppsync.core.frame.numpy_frames import NumpyFrames
from ppsync.core.path.generations import GenerationTable
from ppsync.core.path.ring import SlotRing
from ppsync.core.path.token_path import TokenPath
from ppsync.core.recorder.flight import FlightRecorder
from ppsync.core.recorder.registry import set_world
from ppsync.core.recorder.triggers import dump_all, install_dump_triggers
from ppsync.core.rules import BatchView, batch_view_of, validate_batch
from ppsync.core.rules.mask import need_sampled_mask
from ppsync.core.wire.board import FailureBoard
from ppsync.core.wire.groups import (
    pipeline_groups,
    strided_groups,
    token_group,
    token_group_among,
    token_groups,
)
from ppsync.core.wire.platform import Platform, platform_for

__all__ = [
    "BatchView",
    "DeviceFrames",
    "FailureBoard",
    "FlightRecorder",
    "FrameView",
    "GenerationTable",
    "NumpyFrames",
    "PendingStep",
    "Platform",
    "PreparedStep",
    "ReleasedStep",
    "SampledStep",
    "SlotRing",
    "StepCodec",
    "TokenPath",
    "batch_view_of",
    "dump_all",
    "install_dump_triggers",
    "need_sampled_mask",
    "pipeline_groups",
    "platform_for",
    "set_world",
    "strided_groups",
    "token_group",
    "token_group_among",
    "token_groups",
    "validate_batch",
]
