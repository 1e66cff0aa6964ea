"""The token path's steps with the device codec: streams, events, lifetimes
and deferred verdicts (rule 6 of docs/design.md; docs/design.md section 7).

Last rank, per step: the side stream waits on the main stream (the sampler's
outputs are ready), then packs the frame on the side stream (device ops),
copies the verdict to its host slot without blocking, issues the broadcast
(XPU first synchronizes the main stream), and records the step's event. The
host reads the verdict at its next call once the event completed
(``query()``, never a synchronize); a bad one raises BatchError there, one
step late; the frame already carried FLAG_BAD_VALUES to the receivers.

Receivers: the receive is issued on the side stream after it waits on the
main stream. At consume, the side stream waits for the transfer (NCCL /
XCCL: device-side, ``work.wait()``; gloo: the host observes the work, then
its future syncs the side stream to gloo's copies), checks the frame and
copies the released tensors out on the side stream, records the event; the
main stream waits on it, and the tensors are recorded on the main stream.
The verdict is read when the event has completed: at this consume, or at
the next one (at most one step late). On CPU ops run eagerly, so verdicts
are read at once: the last rank at its next call, receivers at consume.

Nothing here reads device data on the host except the error path, after a
verdict said something is wrong.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from ppsync.core.batch import BatchView
from ppsync.core.checks import check_sampled_meta, check_step_drafts_meta
from ppsync.core.device_codec import (
    V_DRAFTS,
    V_FLAGGED,
    V_FRAME,
    V_NUM_REJECTED,
    V_NUM_SAMPLED,
    DeviceFrameCodec,
)
from ppsync.core.facts import BatchFacts
from ppsync.core.frame import _H_FLAGS, HEADER_WORDS, FrameView, drafts_desync
from ppsync.core.platform import Platform, StepEvent
from ppsync.core.released import ReleasedStep
from ppsync.core.steps import PreparedStep
from ppsync.errors import BatchError, DesyncError
from ppsync.schemas.config import SyncConfig
from ppsync.schemas.records import FLAG_HAS_DRAFTS


@dataclass(slots=True)
class Judged:
    """A step whose verdict the host has not read yet."""

    seq: int
    event: StepEvent
    staging: torch.Tensor  # host; its last word receives the verdict
    buf: torch.Tensor  # the frame (read on the error path only)
    frame: FrameView
    expect_drafts: bool | None = None


class DeviceSteps:
    """The device-codec half of a :class:`~ppsync.core.handler.TokenPath`."""

    def __init__(self, config: SyncConfig, platform: Platform, *, backend: str, rank: int,
                 src: int) -> None:
        self.config = config
        self.platform = platform
        self.codec = DeviceFrameCodec(config, platform.device)
        self.side = platform.new_stream()
        self.stream_ordered = backend in ("nccl", "xccl")
        """The backend orders the collective on streams (NCCL, XCCL): the host
        never waits for it. gloo: the host observes its completion."""
        self.rank = rank
        self.src = src
        self._staging: list[torch.Tensor] = []
        self.unjudged: deque[Judged] = deque()

    def _host(self) -> torch.Tensor:
        if self._staging:
            return self._staging.pop()
        return self.platform.host_buffer(self.codec.staging_words())

    def reuse(self, staging: torch.Tensor) -> None:
        """Give back a staging buffer no pending copy reads."""
        self._staging.append(staging)

    def _verdict(self, staging: torch.Tensor) -> torch.Tensor:
        return staging[-1:]

    # -- last rank --------------------------------------------------------

    def send(
        self,
        frame: FrameView,
        outputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        drafts: torch.Tensor | None,
        issue: Callable[[torch.Tensor], dist.Work],
    ) -> tuple[torch.Tensor, dist.Work, int]:
        """Pack and broadcast one step; returns (frame, work, host flags)."""
        p, codec = self.platform, self.codec
        staging = self._host()
        flags = codec.host_flags(drafts is not None)
        staged = codec.stage(staging, frame, flags)
        main = p.current_stream()
        p.wait_stream(self.side, main)  # the sampler's outputs are complete
        with p.use(self.side):
            buf = codec.new_buffer(frame.num_reqs)
            verdict = codec.pack(buf, staged, *outputs, drafts)
            self._verdict(staging).copy_(verdict, non_blocking=True)
            p.before_send(main)
            work = issue(buf)
            if self.stream_ordered:
                work.wait()  # device-side: the side stream waits for the collective
            event = p.record_event(self.side)
        for t in (*outputs, drafts):
            if t is not None:
                p.record_stream(t, self.side)  # made on the main stream, read on the side
        self.unjudged.append(Judged(frame.seq, event, staging, buf, frame))
        return buf, work, flags

    def judge_sent(self, *, all_: bool = False) -> None:
        """Read the verdicts of sent steps whose event completed (all of them
        with ``all_``, after a drain); raise the first bad one's BatchError."""
        while self.unjudged and (all_ or self.unjudged[0].event.query()):
            j = self.unjudged.popleft()
            if all_:
                j.event.synchronize()  # at close only, never on the hot path
            bad = int(self._verdict(j.staging)[0])  # host memory, written once the event ran
            if bad:
                self.unjudged.clear()
                raise self._sent_error(j)
            self._staging.append(j.staging)

    def _sent_error(self, j: Judged) -> BatchError:
        frame_np = j.buf.cpu().numpy()  # error path only
        w = j.frame.width(self.codec.layout)
        err = self.codec.value_error(frame_np, j.frame.num_reqs, w, "")
        return BatchError(f"{err} (found on the device after step seq {j.seq} was sent: "
                          "reported at the next call; every receiver raises on that frame)")

    # -- receivers --------------------------------------------------------

    def post(
        self, frame: FrameView, issue: Callable[[torch.Tensor], dist.Work]
    ) -> tuple[torch.Tensor, torch.Tensor, dist.Work]:
        """Issue one receive on the side stream; returns (frame, staging, work)."""
        p, codec = self.platform, self.codec
        staging = self._host()
        codec.stage(staging, frame, 0)  # this rank's view: what the frame must say
        p.wait_stream(self.side, p.current_stream())
        with p.use(self.side):
            buf = codec.new_buffer(frame.num_reqs)
            work = issue(buf)
        return buf, staging, work

    def release(
        self,
        frame: FrameView,
        buf: torch.Tensor,
        staging: torch.Tensor,
        work: dist.Work,
        keep: np.ndarray,  # [num_reqs] bool
        idx_np: np.ndarray,  # [num_reqs] int64
        table: torch.Tensor | None,  # [max_num_reqs, K] draft table
        expect_drafts: bool | None,
        host_wait: Callable[[dist.Work], None],
    ) -> ReleasedStep:
        """Check the frame and hand out device tensors (the main stream waits
        on the step's event). The step's own
        verdict is judged now if its event completed, else at the next call
        (the token path judges earlier steps before its ring moves)."""
        p, codec, lay = self.platform, self.codec, self.codec.layout
        n, L, K, R = frame.num_reqs, lay.sample_width, lay.num_drafts, lay.max_num_reqs
        w = frame.width(lay)
        s = staging.numpy()
        base = HEADER_WORDS + 2 * R
        idx_out = np.where(keep, idx_np, -1)
        kept_rows = np.flatnonzero(keep)
        nk = kept_rows.shape[0]
        s[base : base + n] = idx_out
        s[base + R : base + R + nk] = idx_np[kept_rows]
        s[base + 2 * R : base + 2 * R + nk] = kept_rows
        main = p.current_stream()
        with p.use(self.side):
            if self.stream_ordered:
                work.wait()  # device-side
            else:
                host_wait(work)  # gloo: bounded host wait; its future syncs the side stream
            staged = staging[: HEADER_WORDS + 2 * n]
            verdict = codec.check(buf, staged, n, w)
            facts = staging[base : base + 3 * R].to(p.device, non_blocking=True)
            flags = buf[_H_FLAGS : _H_FLAGS + 1]
            has_drafts = (flags & FLAG_HAS_DRAFTS) != 0  # [1] bool, device
            if expect_drafts is not None:
                verdict = verdict + (has_drafts != expect_drafts).to(torch.int64) * V_DRAFTS
            self._verdict(staging).copy_(verdict, non_blocking=True)
            rows = buf[HEADER_WORDS : HEADER_WORDS + n * lay.row_width].view(n, lay.row_width)
            tokens = rows[:, :w].clone()
            num_sampled = rows[:, L].to(torch.int32)
            num_rejected = rows[:, L + 1].to(torch.int32)
            idx_mapping = facts[:n].clone()
            drafts = rows[:, lay.col_drafts : lay.col_slot_need].clone() if K else None
            event = p.record_event(self.side)
        p.wait_event(main, event)
        out = [tokens, num_sampled, num_rejected, idx_mapping]
        if drafts is not None:
            out.append(drafts)
        for t in (*out, facts, has_drafts):
            p.record_stream(t, main)  # made on the side stream, used on the main one
        if table is not None and drafts is not None and nk:
            # rule 4 on the device: kept rows only; a frame without drafts
            # leaves the table as it was (chosen on the device, no host read)
            slots = facts[R : R + nk]
            picked = drafts.index_select(0, facts[2 * R : 2 * R + nk])
            old = table.index_select(0, slots)
            table.index_copy_(0, slots, torch.where(has_drafts, picked.to(table.dtype), old))
        self.unjudged.append(Judged(frame.seq, event, staging, buf, frame, expect_drafts))
        self.judge_received()
        return ReleasedStep(seq=frame.seq, sampled_tokens=tokens, num_sampled=num_sampled,
                            num_rejected=num_rejected, idx_mapping=idx_mapping,
                            draft_tokens=drafts, kept_np=keep)

    def judge_received(self, *, all_: bool = False) -> None:
        """Read received steps' verdicts whose event completed (all with
        ``all_``); raise DesyncError or BatchError for the first bad one."""
        while self.unjudged and (all_ or self.unjudged[0].event.query()):
            j = self.unjudged.popleft()
            if all_:
                j.event.synchronize()  # at close only, never on the hot path
            bad = int(self._verdict(j.staging)[0])
            if bad:
                self.unjudged.clear()
                raise self._received_error(j, bad)
            self._staging.append(j.staging)

    def _received_error(self, j: Judged, bad: int) -> DesyncError | BatchError:
        lay = self.codec.layout
        frame_np = j.buf.cpu().numpy()  # error path only
        if bad & V_FRAME:
            try:
                lay.check(frame_np, j.frame, rank=self.rank)
            except DesyncError as e:
                return e
        if bad & V_DRAFTS and j.expect_drafts is not None:
            has = bool(int(frame_np[_H_FLAGS]) & FLAG_HAS_DRAFTS)
            return drafts_desync(self.rank, j.seq, j.expect_drafts, has, lay.header_dict(frame_np))
        if bad & (V_NUM_SAMPLED | V_NUM_REJECTED | V_FLAGGED):
            prefix = (f"rank {self.rank}: frame seq {j.seq} from the last rank (global rank "
                      f"{self.src}) carries ")
            return self.codec.value_error(frame_np, j.frame.num_reqs, j.frame.width(lay), prefix)
        return DesyncError(f"rank {self.rank}: frame seq {j.seq} fails the device check "
                           f"(verdict {bad})", expected=j.frame.as_dict(lay),
                           received=lay.header_dict(frame_np))


def prepare_device_step(
    view: BatchView, facts: BatchFacts, sampled_token_ids: torch.Tensor, num_sampled: torch.Tensor,
    num_rejected: torch.Tensor, draft_tokens: torch.Tensor | None, sample_width: int | None,
    *, config: SyncConfig, device: torch.device,
) -> tuple[PreparedStep, torch.Tensor | None]:
    """The device codec's prepare (the last rank): dtypes, shapes and devices
    are checked here, before anything is issued; the values are checked on
    the device when the step is sent (a bad one raises at the next call)."""
    outputs = check_sampled_meta(sampled_token_ids, num_sampled, num_rejected,
                                 num_reqs=view.num_reqs, sample_width=config.sample_width,
                                 device=device)
    drafts = None if draft_tokens is None else check_step_drafts_meta(
        draft_tokens, num_reqs=view.num_reqs, num_drafts=config.num_speculative_steps,
        device=device)
    w = outputs[0].shape[1]
    if sample_width is not None and w > sample_width:
        raise BatchError(f"sampled_token_ids.shape[1] = {w} exceeds the "
                         f"step's sample width {sample_width}")
    step = PreparedStep(view, facts, None, None, None, sample_width, outputs)
    return step, drafts
