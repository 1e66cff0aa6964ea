"""The device codec: a token path's steps where the engine's tensors live;
streams, events, lifetimes and deferred verdicts (rule 6 of docs/design.md;
docs/design.md section 7). Frames are packed, checked and released by the
device kernels chosen once (ppsync.core.codec.device_kernels: torch ops or Triton).

Per step the codec itself asks torch for little: the step's host facts go
to the device in one copy (a staging buffer, see
ppsync.core.frame.layout.Staging), the verdict comes back in one copy, and a
receiver allocates the tensors it hands out. Frame buffers are taken from a
pool and given back once their transfer completed and their verdict was
read. Tensors made on one stream and read on the other are made on the
stream that uses them, so no ``record_stream`` is needed.

Last rank, per step: the frame is packed on the current stream, the one that
made the sampler's outputs, before the call returns (the engine may then
write those tensors in place); the verdict is copied to its host slot
without blocking and an event recorded after it; the side stream waits on
the current one and issues the broadcast (XPU first synchronizes the main
stream). The host reads the verdict at its next call once that event
completed (``query()``, never a synchronize); a bad one raises BatchError
there, one step late; the frame already carried FLAG_BAD_VALUES to the
receivers. The frame returns to its pool once its transfer ended (the
group's semantics judge it: ppsync.core.wire.completion) and its verdict was read.

Receivers: the receive is issued on the side stream after it waits on the
main stream. At consume the host waits, bounded, for the transfer's end (the
group's semantics: gloo's work, or NCCL's / XCCL's ``is_completed()``
polled), the outputs are allocated on the main stream, the side stream waits
on the main stream and is ordered after the transfer, checks the frame and
releases it (``Platform.run_on``: a stand-in stream may run it later, as a
device's does), records the event; the main stream waits on it, and only
there waits on a transfer. The verdict is read when the event has
completed: at this consume, or at the next one (at most one step late). On
CPU ops run eagerly, so verdicts are read at once: the last rank at its
next call, receivers at consume.

Nothing here reads device data on the host except the error path, after a
verdict said something is wrong.
"""

from __future__ import annotations

import functools
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from ppsync.core.codec.carriers import Carrier, carrier_for
from ppsync.core.codec.cpu_kernels import cpu_kernels_for
from ppsync.core.codec.device_kernels import DeviceKernels, Outputs, device_kernels_for
from ppsync.core.codec.protocol import Issue, StepDrafts, Wait
from ppsync.core.codec.released import ReleasedStep
from ppsync.core.codec.steps import PendingStep, PreparedStep
from ppsync.core.frame.device_frames import (
    V_DRAFTS,
    V_FLAGGED,
    V_FRAME,
    V_NUM_REJECTED,
    V_NUM_SAMPLED,
    DeviceFrames,
)
from ppsync.core.frame.layout import FLAG_HAS_DRAFTS, FrameView, Header
from ppsync.core.frame.numpy_frames import NumpyFrames, drafts_desync
from ppsync.core.frame.rows import SampledStep
from ppsync.core.rules import BatchView
from ppsync.core.rules.checks import (
    check_draft_table_meta,
    check_sampled_meta,
    check_step_drafts_meta,
    check_width_fits,
    value_bounds,
)
from ppsync.core.rules.facts import BatchFacts
from ppsync.core.wire.completion import Completion
from ppsync.core.wire.platform import Platform, StepEvent
from ppsync.errors import BatchError, DesyncError
from ppsync.schemas.config import SyncConfig

_H_FLAGS = int(Header.FLAGS)


@dataclass(slots=True)
class HostStage:
    """A host staging buffer (pinned on a device) and its views, made once."""

    t: torch.Tensor  # [Staging.words] int64
    np: np.ndarray  # the same memory
    verdict: torch.Tensor  # [1]: the last word, where the device verdict is copied


@dataclass(slots=True)
class Unread:
    """A step whose verdict the host has not read yet."""

    sent: bool  # the last rank sent it (else: received)
    seq: int
    event: StepEvent
    stage: HostStage
    buf: torch.Tensor  # the frame (read on the error path only)
    frame: FrameView
    expect_drafts: bool | None = None
    tokens_w: int = 0  # sent: the tokens' width, num_sampled's bound (as the host codec's)
    wire: torch.Tensor | None = None  # received by the host carrier: its pinned buffer


class DeviceCodec:
    """The device codec's share of a token path (see ppsync.core.codec.protocol)."""

    on_device = True

    def __init__(self, config: SyncConfig, platform: Platform, *, completion: Completion,
                 rank: int, src: int) -> None:
        self.config = config
        self.platform = platform
        self.device = platform.device
        self.device_frames = DeviceFrames(config, platform.device)
        self.frames: NumpyFrames = self.device_frames.layout
        self.kernels = cpu_kernels_for(config, self.frames)  # the batch facts, on the host
        self.device_kernels: DeviceKernels = device_kernels_for(config, self.device_frames)
        """The frames' per-step device work (config.device_kernels)."""
        self.device_kernels_name: str = self.device_kernels.name
        self.buffers = self.device_frames.buffers
        self.carrier: Carrier = carrier_for(config.carrier, platform, self.frames)
        """How the frames travel (ppsync.core.codec.carriers), chosen once."""
        self.side = platform.new_stream()
        self.completion = completion
        """The token group's semantics: how the side stream is ordered after
        a transfer (ppsync.core.wire.completion)."""
        self.rank = rank
        self.src = src
        words = self.frames.staging.words
        self._stage_dev = torch.empty(words, dtype=torch.int64, device=self.device)
        """The step's staging, copied to the device (one per codec: every use
        is ordered on the side stream)."""
        self._verdict_dev = torch.zeros(1, dtype=torch.int64, device=self.device)
        self._free_stages: list[HostStage] = []
        self._stages: dict[int, HostStage] = {}  # by id of the host tensor
        self._holds: dict[int, int] = {}  # sent frames: uses left before the pool takes them
        self.unread: deque[Unread] = deque()
        self._copying: deque[tuple[StepEvent, torch.Tensor]] = deque()
        """Sent frames the host carrier's copy still reads, with its event (in order)."""

    def _host(self) -> HostStage:
        if self._free_stages:
            return self._free_stages.pop()
        t = self.platform.host_buffer(self.frames.staging.words)
        stage = HostStage(t, t.numpy(), t[-1:])
        self._stages[id(t)] = stage
        return stage

    def skip(self, head: PendingStep) -> None:
        """The receive never touches its staging buffer: give it back."""
        if head.staging is not None:
            self._free_stages.append(self._stages[id(head.staging)])

    def close(self) -> None:
        """The side stream is no longer used (a stand-in stream's thread ends)."""
        self.platform.close_stream(self.side)

    def pump(self, wait: bool = False) -> None:
        """Issue the frames whose copies to pinned memory ended (the host
        carrier); with ``wait``, at close, once they ended."""
        self.carrier.pump(wait)

    def hurry(self) -> bool:
        return self.carrier.hurry()

    def on_deferred(self, wake: Callable[[], None]) -> None:
        self.carrier.wake = wake

    def reuse(self, buf: torch.Tensor) -> None:
        """``buf``'s transfer completed: the carrier's own pinned buffer goes
        back to it; a sent device frame to the pool once its verdict was read
        too; a skipped receive's at once."""
        if self.carrier.owns(buf):
            self.carrier.give(buf, None)
        else:
            self._drop(buf)

    def _drop(self, buf: torch.Tensor) -> None:
        left = self._holds.pop(id(buf), 1) - 1
        if left:
            self._holds[id(buf)] = left
        else:
            self.buffers.give(buf)

    def settle(self, all_: bool = False) -> None:
        """Read the verdicts of steps whose event completed (all of them with
        ``all_``, after a drain); raise the first bad one's error. Sent
        frames whose copy to pinned memory ended go back to the pool."""
        copying = self._copying
        while copying and (all_ or copying[0][0].query()):
            copied, buf = copying.popleft()
            if all_:
                copied.synchronize()  # at close only
            self._drop(buf)
        while self.unread and (all_ or self.unread[0].event.query()):
            u = self.unread.popleft()
            if all_:
                u.event.synchronize()  # at close only, never on the hot path
            bad = int(u.stage.np[-1])  # host memory, written once the event ran
            if bad:
                # the later steps stay unread: their buffers may still be in use
                # on the side stream, and their own verdicts are read in turn
                raise self._sent_error(u) if u.sent else self._received_error(u, bad)
            self._free_stages.append(u.stage)
            if u.sent:
                self._drop(u.buf)
            else:
                self.buffers.give(u.buf)  # released: the kernels read it out
                if u.wire is not None:  # its copy to the device came before the event
                    self.carrier.give(u.wire, None)

    # -- last rank --------------------------------------------------------
    def prepare(self, view: BatchView, facts: BatchFacts, sampled: SampledStep
                ) -> tuple[PreparedStep, torch.Tensor | None]:
        """Dtypes, shapes and devices are checked here, before anything is
        issued; the values are checked on the device when the step is sent
        (a bad one raises at the next call)."""
        outputs = check_sampled_meta(sampled.tokens, sampled.num_sampled, sampled.num_rejected,
                                     num_reqs=view.num_reqs,
                                     sample_width=self.config.sample_width, device=self.device)
        drafts = None if sampled.drafts is None else self.check_drafts(sampled.drafts,
                                                                       view.num_reqs)
        check_width_fits(outputs[0].shape[1], sampled.sample_width)
        return PreparedStep(view, facts, SampledStep(*outputs, None, sampled.sample_width)), drafts

    def check_drafts(self, drafts: object, num_reqs: int) -> torch.Tensor:
        if isinstance(drafts, np.ndarray):
            drafts = torch.from_numpy(drafts)
        return check_step_drafts_meta(drafts, num_reqs=num_reqs,
                                      num_drafts=self.config.num_speculative_steps,
                                      device=self.device)

    def step_drafts(self, drafts: object, num_reqs: int) -> StepDrafts:
        return self.check_drafts(drafts, num_reqs)  # shape, dtype, device: values not read

    def check_draft_table(self, table: object) -> object:
        return check_draft_table_meta(table, max_num_reqs=self.frames.max_num_reqs,
                                      num_drafts=self.frames.num_drafts, device=self.device)

    def gather_drafts(self, table: object, idx: np.ndarray) -> StepDrafts:
        """Gathered on the device (rule 4's rows); the slots are host facts,
        staged in pinned memory on a device so the copy never blocks the host
        (torch's host allocator keeps the block until the copy ran)."""
        assert isinstance(table, torch.Tensor)  # check_draft_table returned it
        staged = self.platform.host_buffer(idx.shape[0])
        staged.numpy()[:] = idx
        return table.index_select(0, staged.to(table.device, non_blocking=True))

    def send(self, frame: FrameView, step: PreparedStep, drafts: StepDrafts | None,
             issue: Issue) -> tuple[torch.Tensor, dist.Work, int, int]:
        """Pack and broadcast one step; returns (frame, work, host flags, 0):
        the checksum is on the device, and the host does not read it."""
        r = step.rows
        if not isinstance(r.tokens, torch.Tensor):
            raise BatchError("step was prepared for the host codec; this path uses the "
                             "device codec")
        assert not isinstance(drafts, np.ndarray)  # check_drafts returned a tensor
        rows = r if drafts is None else SampledStep(r.tokens, r.num_sampled, r.num_rejected,
                                                    drafts, r.sample_width)
        p, lay = self.platform, self.frames
        stage = self._host()
        flags = lay.flags(drafts is not None)
        w = rows.tokens.shape[1]
        self.device_frames.stage(stage.np, frame, flags,
                                 value_bounds(w, lay.num_drafts, frame.width(lay)))
        # Own what is sent: the frame is packed on the stream that made the
        # sampler's outputs (the current one), before publish returns, so the
        # engine may write those tensors in place at once; only the frame
        # crosses to the side stream.
        main = p.current_stream()
        buf = self.buffers.take(frame.num_reqs)
        self._stage_dev.copy_(stage.t, non_blocking=True)
        self.device_kernels.pack(buf, self._stage_dev, frame.num_reqs, rows, self._verdict_dev)
        stage.verdict.copy_(self._verdict_dev, non_blocking=True)
        # the verdict is ready once the current stream ran this far; it does
        # not wait for the transfer (whose end returns the buffer: reuse())
        event = p.record_event(main)
        wire, work, read_out = self.carrier.send(p, main, self.side, buf, frame.num_reqs,
                                                 issue)
        self._holds[id(buf)] = 2  # its transfer (or its copy to pinned memory), and its verdict
        if wire is not buf:  # copied out: the copy's end frees it, the transfer reads ``wire``
            assert read_out is not None
            self._copying.append((read_out, buf))
        self.unread.append(Unread(True, frame.seq, event, stage, buf, frame, tokens_w=w))
        return wire, work, flags, 0

    def _sent_error(self, u: Unread) -> BatchError:
        frame_np = u.buf.cpu().numpy()  # error path only
        err = self.device_frames.value_error(frame_np, u.frame.num_reqs, u.tokens_w,
                                             u.frame.width(self.frames), "")
        return BatchError(f"{err} (found on the device after step seq {u.seq} was sent: "
                          "reported at the next call; every receiver raises on that frame)")

    # -- receivers --------------------------------------------------------

    def post(self, frame: FrameView, issue: Issue
             ) -> tuple[torch.Tensor, torch.Tensor | None, dist.Work]:
        """Issue one receive on the side stream; returns (frame, staging, work)."""
        p, lay = self.platform, self.frames
        stage = self._host()
        w = frame.width(lay)  # this rank's view: what the frame must say
        self.device_frames.stage(stage.np, frame, 0, value_bounds(w, lay.num_drafts, w))
        wire, work = self.carrier.post(p, self.side, frame.num_reqs,
                                       lambda: self.buffers.take(frame.num_reqs), issue)
        return wire, stage.t, work

    def release(self, head: PendingStep, keep: np.ndarray, kept: int,
                table: torch.Tensor | None, wait: Wait, rank: int) -> ReleasedStep:
        """Check the frame and hand out device tensors (the main stream waits
        on the step's event). The step's own verdict is read now if its event
        completed, else at the next call (the token path settles earlier
        steps before its ring moves)."""
        frame, wire, work = head.frame, head.buf, head.work
        assert head.staging is not None  # post() staged this rank's view
        stage = self._stages[id(head.staging)]
        idx_np, expect_drafts = head.idx_np, head.expect_drafts
        p, lay, dev = self.platform, self.frames, self.device
        n, K = frame.num_reqs, lay.num_drafts
        s, at = stage.np, lay.staging
        kept_rows = np.flatnonzero(keep)
        nk = kept_rows.shape[0]
        np.copyto(s[at.idx_out : at.idx_out + n], np.where(keep, idx_np, -1))
        s[at.kept_slots : at.kept_slots + nk] = idx_np[kept_rows]
        s[at.kept_rows : at.kept_rows + nk] = kept_rows
        main = p.current_stream()
        # bounded: the host polls (stream-ordered) or waits (gloo) for the
        # transfer's end; a dead or silent peer raises here, named
        wait(work, frame.seq)
        hand_drafts = K > 0 and self._has_drafts(wire, expect_drafts)  # after the wait
        # made on the main stream, which uses them (no record_stream)
        out = Outputs(torch.empty((n, frame.width(lay)), dtype=torch.int64, device=dev),
                      torch.empty((2, n), dtype=torch.int32, device=dev),
                      torch.empty(n, dtype=torch.int64, device=dev),
                      torch.empty((n, K), dtype=torch.int64, device=dev) if hand_drafts
                      else None)
        release_table = table if hand_drafts else None

        def check_release(buf: torch.Tensor) -> None:  # the host carrier copied it here
            self._stage_dev.copy_(stage.t, non_blocking=True)
            self.device_kernels.release(buf, self._stage_dev, n, expect_drafts, out,
                                        release_table, nk, self._verdict_dev)
            stage.verdict.copy_(self._verdict_dev, non_blocking=True)

        p.wait_stream(self.side, main)  # the main stream's earlier use of their memory
        with p.use(self.side):
            self.completion.order_after(work)  # the consume: the side stream after the transfer
            buf = self.carrier.landed(p, self.side, wire, lambda: self.buffers.take(n))
            p.run_on(self.side, functools.partial(check_release, buf))
            event = p.record_event(self.side)
        p.wait_event(main, event)  # the engine's stream waits here, at consume, only
        num_sampled, num_rejected = out.counts.unbind()
        self.unread.append(Unread(False, frame.seq, event, stage, buf, frame, expect_drafts,
                                  wire=None if buf is wire else wire))
        self.settle()
        return ReleasedStep(seq=frame.seq, sampled_tokens=out.tokens, num_sampled=num_sampled,
                            num_rejected=num_rejected, idx_mapping=out.idx_mapping,
                            draft_tokens=out.drafts, kept_np=keep)

    def _has_drafts(self, buf: torch.Tensor, expect_drafts: bool | None) -> bool:
        """Whether a received frame's drafts are handed out, as the host codec
        decides (the frame's FLAG_HAS_DRAFTS), without a host sync: what the
        receiver expects (a frame that disagrees raises at its verdict), else
        the flag itself where the host reads the device for free (CPU). On an
        accelerator with ``expect_drafts`` None the flag stays on the device:
        drafts are handed out (rows of -1 for a frame without them) and the
        draft table is left as it was (docs/design.md section 7)."""
        if expect_drafts is not None:
            return expect_drafts
        if self.carrier.reads_free(buf):
            return bool(buf.numpy()[_H_FLAGS] & FLAG_HAS_DRAFTS)
        return True

    def _received_error(self, j: Unread, bad: int) -> DesyncError | BatchError:
        lay = self.frames
        frame_np = j.buf.cpu().numpy()  # error path only
        if bad & V_FRAME:
            try:
                lay.check(frame_np, j.frame, rank=self.rank)
            except DesyncError as e:
                return e
        if bad & V_DRAFTS and j.expect_drafts is not None:
            has = lay.has_drafts(frame_np)
            return drafts_desync(self.rank, j.seq, j.expect_drafts, has, lay.header_dict(frame_np))
        if bad & (V_NUM_SAMPLED | V_NUM_REJECTED | V_FLAGGED):
            prefix = (f"rank {self.rank}: frame seq {j.seq} from the last rank (global rank "
                      f"{self.src}) carries ")
            w = j.frame.width(lay)
            return self.device_frames.value_error(frame_np, j.frame.num_reqs, w, w, prefix)
        return DesyncError(f"rank {self.rank}: frame seq {j.seq} fails the device check "
                           f"(verdict {bad})", expected=j.frame.as_dict(lay),
                           received=lay.header_dict(frame_np))

