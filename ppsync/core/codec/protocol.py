"""The codec protocol: what a token path asks of its frames' codec, and its types.

Two codecs implement it: the host codec (ppsync.core.codec.host:
frames in numpy on the host, every value checked before the send) and the
device codec (ppsync.core.codec.device: frames in torch ops where the
engine's tensors live, values checked on the device and their verdicts read
when the step's event completed). ``ppsync.core.codec.codec_for`` picks one
from ``config.codec``; the token path and the vLLM adapter call only what is
declared here and never ask where frames live. The rules a step's values follow (sample width,
num_sampled, num_rejected) are in ppsync.core.rules.checks, shared by both.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import numpy as np
import torch
import torch.distributed as dist

from ppsync.core.codec.cpu_kernels import CpuKernels
from ppsync.core.codec.released import ReleasedStep
from ppsync.core.codec.steps import PendingStep, PreparedStep
from ppsync.core.frame.layout import BufferPool, FrameView
from ppsync.core.frame.numpy_frames import NumpyFrames
from ppsync.core.frame.rows import SampledStep
from ppsync.core.rules import BatchView
from ppsync.core.rules.facts import BatchFacts
from ppsync.core.wire.backends import carried_by
from ppsync.core.wire.completion import Completion
from ppsync.core.wire.platform import Platform
from ppsync.errors import ConfigError
from ppsync.schemas.config import CodecName, SyncConfig, frames_on_device

StepDrafts = np.ndarray | torch.Tensor
"""One step's drafts, [num_reqs, K]: a host array (host codec) or a tensor on
the codec's device (device codec), as :meth:`StepCodec.prepare` returns them."""

Issue = Callable[[torch.Tensor], dist.Work]
"""Issues a frame's collective; never blocks."""

Wait = Callable[[dist.Work, int], None]
"""(work, seq): returns once frame seq's receive completed (bounded; raises
the path's error)."""


class StepCodec(Protocol):
    """A codec's share of one token path's steps."""

    on_device: bool
    """Frames live on :attr:`device` and the engine's tensors must too; their
    values are checked there, and a bad one raises one call later."""
    device: torch.device
    """Where the frames and the engine's tensors live (CPU for the host codec)."""
    frames: NumpyFrames
    """The host frames: layout, digests, and the checks' error path."""
    buffers: BufferPool
    """Where this codec's frame buffers come from."""
    device_kernels_name: str
    """The device kernels' set ("torch", "triton"; "none": the host codec):
    every rank of a group must have the same (the handshake compares it)."""
    kernels: CpuKernels
    """The CPU kernels (config.cpu_kernels): a step's batch facts, and
    the host codec's checks, packing and release."""

    def settle(self, all_: bool = False) -> None:
        """Read the verdicts of steps whose event completed (every one with
        ``all_``, after a drain); raise the first bad one's BatchError or
        DesyncError. The host codec defers nothing."""

    def prepare(
        self, view: BatchView, facts: BatchFacts, sampled: SampledStep,
    ) -> tuple[PreparedStep, StepDrafts | None]:
        """Check one step's sampled rows: its tokens, counts, drafts and
        width (last rank)."""

    def check_drafts(self, drafts: object, num_reqs: int) -> StepDrafts:
        """Check drafts handed to send (the last rank): [num_reqs, K]."""

    def step_drafts(self, drafts: object, num_reqs: int) -> StepDrafts:
        """The engine's drafts of one step, [num_reqs, K] already gathered,
        as this codec sends them (the host codec checks and copies them to
        the host; the device codec leaves them where they are: the send
        checks them)."""

    def check_draft_table(self, table: object) -> object:
        """Check the engine's draft table [max_num_reqs, K] by request slot
        (a BatchError names what is wrong); the table, as
        :meth:`gather_drafts` takes it."""

    def gather_drafts(self, table: object, idx: np.ndarray) -> StepDrafts:
        """The rows ``idx`` (a step's request slots, rule 4) of a table that
        :meth:`check_draft_table` returned: [num_reqs, K], the caller's own."""

    def send(self, frame: FrameView, step: PreparedStep, drafts: StepDrafts | None,
             issue: Issue) -> tuple[torch.Tensor, dist.Work, int, int]:
        """Pack and issue one step's frame; (buffer, work, flags, checksum)."""

    def post(self, frame: FrameView, issue: Issue
             ) -> tuple[torch.Tensor, torch.Tensor | None, dist.Work]:
        """Issue one receive; (buffer, staging or None, work)."""

    def release(self, head: PendingStep, keep: np.ndarray, kept: int,
                table: torch.Tensor | None, wait: Wait, rank: int) -> ReleasedStep:
        """Wait for ``head``'s frame, check it and hand out its kept rows
        (``keep`` [num_reqs] bool, ``kept`` of them); scatter kept drafts
        into ``table``."""

    def skip(self, head: PendingStep) -> None:
        """``head`` is released with no row kept: its frame is never read."""

    def reuse(self, buf: torch.Tensor) -> None:
        """``buf``'s transfer completed and nothing reads it any more."""

    def pump(self, wait: bool = False) -> None:
        """Issue the frames that waited for their copy to pinned memory and
        whose copy ended (the host carrier; ppsync.core.codec.carriers).
        Called by every call of the token path and by the rank's watcher;
        with ``wait`` (a drain at close only), first wait for those copies."""

    def hurry(self) -> bool:
        """Whether a frame waits for its copy (its watcher then looks often)."""

    def on_deferred(self, wake: Callable[[], None]) -> None:
        """Call ``wake`` whenever a frame starts to wait for its copy (the
        rank's watcher then pumps until it goes)."""

    def close(self) -> None:
        """The path closed: nothing is issued or released any more."""


def default_codec(device: torch.device, *, emulated: bool = False) -> CodecName:
    """The codec an engine on ``device`` gets when it names none, decided
    here only: on an accelerator the device codec (its engine must not sync
    per step, so its frames stay there); under the CPU twin (``emulated``)
    too, since the twin carries device frames as NCCL does; else
    SyncConfig's default, the host codec."""
    if emulated or device.type != "cpu":
        return "device"
    codec: CodecName = SyncConfig.model_fields["codec"].default
    return codec


def frames_home(codec: str, carrier: str, platform: Platform) -> tuple[str, Platform | None]:
    """(the token group's backend, the platform a token path takes; None:
    the CPU's) for frames of ``codec`` carried by ``carrier`` in an engine
    on ``platform`` (ppsync.core.wire.backends.carried_by)."""
    if frames_on_device(codec):
        return carried_by(carrier, platform.name), platform
    return "gloo", None


def check_frames(config: SyncConfig, completion: Completion, backend: str) -> None:
    """ConfigError unless a group of ``completion`` (``backend``) can carry
    ``config``'s frames."""
    on_device = frames_on_device(config.codec)
    if completion.device_only and on_device and config.carrier == "host":
        raise ConfigError(f"carrier = 'host' sends frames over gloo from pinned host memory; "
                          f"the token group ({backend}, {completion.name}) takes device "
                          "tensors only: make the token group gloo, or use carrier = 'device'")
    if completion.device_only and not on_device:
        raise ConfigError(f"codec = {config.codec!r} frames are host buffers; the token "
                          f"group ({backend}, {completion.name}) takes device tensors "
                          "only: use codec = 'device'")
    if completion.stream_ordered and config.wire == "exact":
        raise ConfigError(
            f"wire = 'exact' sizes each frame by its step; on a {completion.name} group "
            f"({backend}) a size that differs between ranks is undefined behaviour (a hang "
            "or corrupt data), not an error: use wire = 'fixed'")
