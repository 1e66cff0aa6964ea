"""Synchronous core (torch + numpy): need-sampled mask, generation table,
slot ring, the frame and its two codecs (host: numpy; device: torch ops),
platforms (cpu, cuda, xpu), process groups, the failure board, the flight
recorder and its dumps, and the token path that combines them."""

# isort: off
# first: an unsupported torch is refused before anything binds to it
from ppsync.core.torch_support import TORCH_OLDEST  # noqa: F401
# isort: on
from ppsync.core.aux_relay import AuxRelay
from ppsync.core.batch import BatchView, batch_view_of, validate_batch
from ppsync.core.batch.mask import need_sampled_mask
from ppsync.core.codec import StepCodec
from ppsync.core.dump_registry import set_world
from ppsync.core.dump_triggers import dump_all, install_dump_triggers
from ppsync.core.frame import FrameView
from ppsync.core.frame.device_frames import DeviceFrames
from ppsync.core.frame.host_frames import HostFrames
from ppsync.core.generations import GenerationTable
from ppsync.core.groups import (
    pipeline_layout,
    strided_layout,
    token_group,
    token_group_in_layout,
    token_groups,
)
from ppsync.core.liveness import FailureBoard
from ppsync.core.platform import Platform, platform_for
from ppsync.core.recorder import FlightRecorder
from ppsync.core.records import PendingStep, PreparedStep
from ppsync.core.released import ReleasedStep
from ppsync.core.ring import SlotRing
from ppsync.core.token_path import TokenPath

__all__ = [
    "AuxRelay",
    "BatchView",
    "DeviceFrames",
    "FailureBoard",
    "FlightRecorder",
    "FrameView",
    "GenerationTable",
    "HostFrames",
    "PendingStep",
    "Platform",
    "PreparedStep",
    "ReleasedStep",
    "SlotRing",
    "StepCodec",
    "TokenPath",
    "batch_view_of",
    "dump_all",
    "install_dump_triggers",
    "need_sampled_mask",
    "pipeline_layout",
    "platform_for",
    "set_world",
    "strided_layout",
    "token_group",
    "token_group_in_layout",
    "token_groups",
    "validate_batch",
]
