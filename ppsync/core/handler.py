"""The synchronous token path of one rank: mask, ring, generations and frame
over one process group.

Per engine step, on every rank and in this order:

- receivers (every rank but the last): :meth:`TokenPath.consume` (releases
  the step posted D steps ago), :meth:`TokenPath.free` for freed request slots,
  then :meth:`TokenPath.post` with the new step's batch view; a step with an
  empty schedule (no batch) skips ``post``, on every rank alike, and its ring
  slot stays empty;
- the last rank: :meth:`TokenPath.free` for freed slots, then
  :meth:`TokenPath.publish` with the batch view and the sampler's outputs.

Every input is checked before any collective is issued, so a bad call on one
rank raises there and leaves the group usable. Every wait is bounded by
``config.timeout_s``.

This file holds only what needs the path's state (ring, in-flight works,
sequence numbers, the failure board); each rule it applies lives in its own
module (mask, ring, generations, frame, checks, transport, liveness and
failures, release, recorder; the step records in steps); with
``codec="device"`` the packing, checks, streams, events and deferred
verdicts are in device_codec and device_steps, and this file only branches
to them.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Literal, TypeVar

import numpy as np
import torch
import torch.distributed as dist

from ppsync.core.batch import BatchView
from ppsync.core.checks import (
    check_draft_target,
    check_drafts_array,
    check_sampled,
    check_step_drafts,
    check_step_drafts_meta,
)
from ppsync.core.device_steps import DeviceSteps, prepare_device_step
from ppsync.core.dumps import dump_file, dump_on_error, records_errors, register, write_dump
from ppsync.core.facts import BatchFacts, batch_facts
from ppsync.core.failures import named_failure, wait_bounded
from ppsync.core.frame import FrameCodec, FrameView, check_sample_width
from ppsync.core.generations import GenerationTable
from ppsync.core.groups import group_facts
from ppsync.core.handshake import Handshake
from ppsync.core.liveness import FailureBoard
from ppsync.core.platform import Platform, platform_for
from ppsync.core.recorder import FlightRecorder
from ppsync.core.release import release_host
from ppsync.core.released import ReleasedStep
from ppsync.core.ring import SlotRing
from ppsync.core.steps import TOKEN_PATH_NAMES, CallNames, PendingStep, PreparedStep
from ppsync.core.teardown import bound_group_timeout, keep_until_exit
from ppsync.core.transport import Broadcaster, TransportClock, ended_ok, finished
from ppsync.errors import (
    BatchError,
    ConfigError,
    DesyncError,
    PPSyncError,
    ProtocolError,
    RoleError,
)
from ppsync.schemas.config import SyncConfig

T = TypeVar("T")


class TokenPath:
    """One rank's synchronous token path over ``group`` (the dedicated token
    group: same ranks as the PP group, last group rank samples)."""

    def __init__(
        self,
        config: SyncConfig,
        group: dist.ProcessGroup,
        *,
        board: FailureBoard | Literal["group"] | None = "group",
        names: CallNames = TOKEN_PATH_NAMES,
        wait_handshake: bool = True,
        device: torch.device | str | None = None,
        platform: str | Platform | None = None,
    ) -> None:
        """``board``: where ranks post failures, so that one cause gives one
        error type on every rank, naming the culprit (see
        ppsync.core.liveness); "group" (the default): a board in the group's
        own store; None: no board, each rank reports only what it saw.
        ``names``: the caller's names for consume/post/publish, used in errors.
        ``device``: where the device codec's frames live (default CPU);
        ``platform``: cpu, cuda or xpu (default: the device's type)."""
        rank, size, group_ranks, backend = group_facts(group)
        if size != config.pp_size:
            raise ConfigError(
                f"pp_size = {config.pp_size} but the group has {size} ranks; they must match"
            )
        self.config = config
        self.names = names
        self.group = group
        self.rank = rank
        self.is_last = self.rank == config.pp_size - 1
        self.group_ranks = group_ranks
        self.global_rank = group_ranks[rank]
        self.src = group_ranks[config.pp_size - 1]
        self.board = FailureBoard.of_group(group) if board == "group" else board
        bound_group_timeout(group, config.timeout_s)
        self.transport: Broadcaster = Broadcaster(group, config.pp_size - 1)
        """Issues each frame's collective (``issue(buf) -> Work``); a benchmark
        may put a loopback in its place (ppsync.bench.loopback)."""
        self.platform = (platform if isinstance(platform, Platform)
                         else platform_for(device, platform))
        self.backend = backend
        on_device = self.backend in ("nccl", "xccl")  # these take device tensors only
        if on_device and config.codec != "device":  # before the handshake: nothing issued
            raise ConfigError(f"codec = {config.codec!r} frames are host buffers; the token "
                              f"group's backend {self.backend} needs codec = 'device'")
        self.handshake: Handshake | None = Handshake(
            config, group, rank=self.rank, device=self.platform.device if on_device else None)
        """Issued at once; finished here, or by the caller (``wait_handshake``
        False: an event loop awaits its work, then calls finish_handshake)."""
        self.run_id = 0
        """Agreed by every rank at the handshake; scopes the failure board."""
        if wait_handshake:
            self.finish_handshake()
        self.codec = FrameCodec(config)
        self.device_steps: DeviceSteps | None = None
        """With ``config.codec == "device"``: the device codec's steps."""
        if config.codec == "device":
            self.device_steps = DeviceSteps(config, self.platform, backend=self.backend,
                                            rank=self.rank, src=self.src)
        self.generations = GenerationTable(config.max_num_reqs)
        self.ring: SlotRing[PendingStep] = SlotRing(config.depth)
        self.seq = 0  # frames issued on this group so far
        self.steps = 0  # post/publish calls so far
        self._tail_open = False  # receivers: consume() reserved a tail not yet posted
        self._inflight: deque[tuple[torch.Tensor, dist.Work]] = deque()
        self._closed = False
        self.last_issue: tuple[int, torch.Tensor, dist.Work] | None = None
        """(seq, buffer, work) of the most recent collective issued."""
        self.clock: TransportClock | None = None
        """When set, collects the CPU time of issues and of real waits."""
        self.recorder = FlightRecorder(config.flight_events, is_last=self.is_last,
                                       depth=config.depth)
        """This path's flight recorder (ppsync.core.recorder); see :meth:`dump`."""
        register(self)

    def finish_handshake(self) -> None:
        """Check the start-up handshake (DesyncError if any rank's
        configuration differs) and bind the board to the agreed run id.
        Every other call needs it done."""
        if self.handshake is None:
            return
        self.run_id = self.handshake.finish()
        self.handshake = None
        if self.board is not None:
            self.board.bind_run(self.run_id)

    def _issue(self, buf: torch.Tensor) -> dist.Work:
        if self.clock is None:
            return self.transport.issue(buf)
        t0 = time.thread_time_ns()
        try:
            return self.transport.issue(buf)
        finally:
            self.clock.issue_ns += time.thread_time_ns() - t0

    # -- shared ---------------------------------------------------------

    @records_errors
    def free(self, req_idx: int) -> None:
        """Request slot ``req_idx`` was freed (finish, abort, preemption)."""
        self._check_open()
        self.generations.bump(req_idx)
        self.recorder.free(self.steps, req_idx, self.generations.generation(req_idx))

    def inflight_works(self) -> Iterator[dist.Work]:
        """Works issued and not yet known complete (last rank: sends; other
        ranks: receives not waited by a consume)."""
        return (w for _, w in self._inflight)

    def works_before_issue(self) -> list[dist.Work]:
        """Works that the next send/consume would wait on synchronously (the
        oldest beyond D in flight); an async caller awaits these first so the
        call never blocks."""
        excess = len(self._inflight) - self.config.depth
        return [w for _, w in list(self._inflight)[: max(0, excess)]]

    def _check_open(self) -> None:
        if self._closed:
            raise ProtocolError(f"rank {self.rank}: token path used after close()")
        if self.handshake is not None:
            raise ProtocolError(f"rank {self.rank}: token path used before its start-up "
                                "handshake finished (finish_handshake())")

    def require_role(self, op: str, *, last: bool) -> None:
        """Raise RoleError unless this rank is (``last``) or is not the last
        rank; ProtocolError after close(). For adapters checking first."""
        self._check_role(op, last=last)

    def _check_role(self, op: str, *, last: bool) -> None:
        self._check_open()
        if self.is_last != last:
            who = "the last rank" if last else "a non-last rank"
            raise RoleError(
                f"{op}() belongs to {who}; group rank {self.rank} of pp_size "
                f"{self.config.pp_size} is {'the last' if self.is_last else 'not the last'} rank"
            )

    def _prune(self) -> None:
        """Drop completed works; wait the oldest while more than D are held."""
        inflight = self._inflight
        while inflight:
            buf, work = inflight[0]
            if not ended_ok(work):
                if len(inflight) <= self.config.depth and not finished(work):
                    break
                self._wait(work, "earlier transfer")  # waits, or raises its failure
            inflight.popleft()
            self.recorder.complete(work, self.steps)
            if self.device_steps is None:
                self.codec.recycle(buf)

    def _wait(self, work: dist.Work, what: str) -> None:
        """Wait at most timeout_s (see ppsync.core.failures.wait_bounded)."""
        if self.clock is None or finished(work):
            self._wait_untimed(work, what)
            return
        t0 = time.thread_time_ns()
        try:
            self._wait_untimed(work, what)
        finally:
            self.clock.wait_ns += time.thread_time_ns() - t0

    def _wait_untimed(self, work: dist.Work, what: str) -> None:
        wait_bounded(work, f"rank {self.rank}: {what}", timeout_s=self.config.timeout_s,
                     board=self.board,
                     failed=lambda err, observed: self.failed(err, observed=observed))

    def failed(
        self, err: PPSyncError, *, settle: bool = True, observed: bool = True
    ) -> PPSyncError:
        """The error to raise for ``err``: the same type on every rank for one
        cause, naming the culprit where the board knows it (see
        ppsync.core.failures.named_failure); ``err`` itself without a board.
        The error is recorded and, with a dump directory, dumped; its message
        names the file."""
        named = named_failure(err, self.board, rank=self.rank, settle=settle,
                              observed=observed)
        dump_on_error(self, named)
        return named

    def leave(self, reason: str) -> None:
        """Tell the peers (on the board) that this rank left its token path
        mid-run, e.g. its engine raised: their waits end at their next board
        check, naming this rank, instead of at their timeout."""
        if self.board is not None and not self.board.has_posted:
            self.board.post("Left", reason)

    # -- last rank --------------------------------------------------------

    @records_errors
    def prepare(
        self,
        view: BatchView,
        sampled_token_ids: torch.Tensor,
        num_sampled: torch.Tensor,
        num_rejected: torch.Tensor,
        draft_tokens: torch.Tensor | None = None,
        *,
        sample_width: int | None = None,
    ) -> tuple[PreparedStep, np.ndarray | torch.Tensor | None]:
        """Check one step's batch view, sampler outputs and (optional) drafts
        [num_reqs, K] (last rank); nothing is sent. Returns the prepared step
        and the drafts' host array (device codec: the drafts tensor).
        ``sample_width``: this step's width w (1..L; tokens at most w wide),
        for engines that vary it per step.

        Device codec: dtypes, shapes and the batch view are checked here; the
        values of num_sampled / num_rejected are checked on the device, and a
        bad one raises BatchError at the next call (see ppsync.core.device_steps)."""
        return self._prepare(view, sampled_token_ids, num_sampled, num_rejected, draft_tokens,
                             sample_width)

    def _prepare(
        self, view: BatchView, sampled_token_ids: torch.Tensor, num_sampled: torch.Tensor,
        num_rejected: torch.Tensor, draft_tokens: torch.Tensor | None,
        sample_width: int | None,
    ) -> tuple[PreparedStep, np.ndarray | torch.Tensor | None]:
        self._check_role(self.names.publish, last=True)
        if self.device_steps is not None:
            self.device_steps.judge_sent()
        check_sample_width(sample_width, self.config.sample_width)
        facts = batch_facts(view, self.config.max_num_reqs)
        if self.device_steps is not None:
            return prepare_device_step(view, facts, sampled_token_ids, num_sampled,
                                       num_rejected, draft_tokens, sample_width,
                                       config=self.config, device=self.platform.device)
        tokens_np, ns_np, nr_np = check_sampled(
            sampled_token_ids, num_sampled, num_rejected,
            num_reqs=view.num_reqs,
            sample_width=self.config.sample_width,
            num_drafts=self.config.num_speculative_steps,
        )
        drafts_np = None if draft_tokens is None else check_step_drafts(
            draft_tokens, num_reqs=view.num_reqs, num_drafts=self.config.num_speculative_steps,
        )
        if sample_width is not None and tokens_np.shape[1] > sample_width:
            raise BatchError(f"sampled_token_ids.shape[1] = {tokens_np.shape[1]} exceeds the "
                             f"step's sample width {sample_width}")
        return PreparedStep(view, facts, tokens_np, ns_np, nr_np, sample_width), drafts_np

    @records_errors
    def send(
        self, step: PreparedStep, drafts_np: np.ndarray | torch.Tensor | None = None
    ) -> int:
        """Broadcast a prepared step (drafts_np: [num_reqs, K] or None; the
        device codec takes a tensor). Returns the rows needing a sample; 0
        means the step had no transfer."""
        return self._send(step, drafts_np)

    def _send(
        self, step: PreparedStep, drafts_np: np.ndarray | torch.Tensor | None = None
    ) -> int:
        self._check_role(self.names.publish, last=True)
        if not isinstance(step, PreparedStep):
            raise BatchError(f"step must be a PreparedStep from prepare(), got "
                             f"{type(step).__name__}")
        if self.device_steps is not None:
            self.device_steps.judge_sent()
            if isinstance(drafts_np, np.ndarray):
                drafts_np = torch.from_numpy(drafts_np)
            if drafts_np is not None:
                drafts_np = check_step_drafts_meta(
                    drafts_np, num_reqs=step.view.num_reqs,
                    num_drafts=self.config.num_speculative_steps, device=self.platform.device)
        elif drafts_np is not None:
            check_drafts_array(drafts_np, num_reqs=step.view.num_reqs,
                               num_drafts=self.config.num_speculative_steps)
        self.steps += 1
        facts = step.facts
        needed = facts.needed
        if needed == 0:
            self.recorder.call(True, self.steps - 1, 0, step.view.num_reqs)
            return 0
        self._prune()
        codec = self.codec
        frame = self._frame_view(facts, step.sample_width)
        if self.device_steps is not None:
            if step.outputs is None:
                raise BatchError("step was prepared for the host codec; this path uses the "
                                 "device codec")
            assert not isinstance(drafts_np, np.ndarray)
            buf, work, flags = self.device_steps.send(frame, step.outputs, drafts_np,
                                                      self._issue)
            checksum = 0  # on the device; the host does not read it
        else:
            if step.tokens_np is None or step.num_sampled_np is None or (
                    step.num_rejected_np is None):
                raise BatchError("step was prepared for the device codec; this path uses "
                                 "the host codec")
            assert not isinstance(drafts_np, torch.Tensor)
            buf = codec.new_buffer(frame.num_reqs)
            flags, checksum = codec.pack(buf.numpy(), frame, step.tokens_np,
                                         step.num_sampled_np, step.num_rejected_np, drafts_np)
            work = self._issue(buf)
        self.recorder.issue(work, self.steps - 1, self.seq, 0, frame.num_reqs, needed,
                            frame.idx_digest, checksum, flags)
        self._inflight.append((buf, work))
        self.last_issue = (self.seq, buf, work)
        self.seq += 1
        return needed

    @records_errors
    def publish(
        self,
        view: BatchView,
        sampled_token_ids: torch.Tensor,  # [num_reqs, w] int64, 1 <= w <= L
        num_sampled: torch.Tensor,  # [num_reqs] int32
        num_rejected: torch.Tensor,  # [num_reqs] int32
        draft_tokens: torch.Tensor | None = None,  # [num_reqs, K] int64
    ) -> int:
        """Check and broadcast one step (last rank). Returns the rows needing a
        sample; 0 means the step had no transfer on any rank."""
        return self._send(*self._prepare(view, sampled_token_ids, num_sampled, num_rejected,
                                         draft_tokens, None))

    def _frame_view(self, facts: BatchFacts, sample_width: int | None) -> FrameView:
        """This rank's view of the frame it issues next."""
        row_facts = facts.row_facts
        return FrameView(self.seq, facts.need.shape[0], self.codec.facts_digest(row_facts),
                         facts.slot_need, facts.computed, sample_width, row_facts)

    # -- receivers --------------------------------------------------------

    @records_errors
    def post(
        self, view: BatchView, *, expect_drafts: bool | None = None,
        sample_width: int | None = None,
    ) -> int:
        """Post this step's receive into the ring's tail (non-last ranks).
        Returns the rows needing a sample; 0 means no transfer this step.
        ``expect_drafts``: whether the frame must carry drafts (a frame that
        disagrees is a DesyncError at consume); ``sample_width``: the step's
        width w (1..L), checked against the header and the width released."""
        self._check_role(self.names.post, last=False)
        check_sample_width(sample_width, self.config.sample_width)
        if expect_drafts is not None and not isinstance(expect_drafts, bool):
            raise BatchError(f"expect_drafts = {expect_drafts!r} must be a bool or None")
        if not self._tail_open:
            c, p = self.names.consume, self.names.post
            raise ProtocolError(
                f"rank {self.rank}: {p}() without a {c}() before it; each step is "
                f"{c}() then {p}()"
            )
        # the facts are copies: the engine may refill its batch arrays before
        # this step is consumed
        facts = batch_facts(view, self.config.max_num_reqs)
        needed = facts.needed
        self._tail_open = False
        self.steps += 1
        if needed == 0:
            self.recorder.call(False, self.steps - 1, self.ring.advanced, view.num_reqs)
            return 0
        frame = self._frame_view(facts, sample_width)
        staging = None
        if self.device_steps is not None:
            buf, staging, work = self.device_steps.post(frame, self._issue)
        else:
            buf = self.codec.new_buffer(frame.num_reqs)
            work = self._issue(buf)
        self.recorder.issue(work, self.steps - 1, self.seq, self.ring.advanced, frame.num_reqs,
                            needed, frame.idx_digest, 0, 0)
        self.ring.fill_tail(PendingStep(frame, facts.need, needed, facts.idx,
                                        self.generations.mark(), buf, work, expect_drafts,
                                        staging))
        self.last_issue = (self.seq, buf, work)
        self.seq += 1
        return needed

    def head_work(self) -> dist.Work | None:
        """The work the next :meth:`consume` will wait on, or None when it will
        not wait (an empty slot, or every row excluded)."""
        if self.is_last or self._closed:
            return None
        head = self.ring.head()
        if head is None or self._keep(head)[1] == 0:
            return None
        return head.work

    def _keep(self, head: PendingStep) -> tuple[np.ndarray, int]:
        """([num_reqs] bool, their count): rows that needed a sample and whose
        slot was not freed since the receive was posted (the usual step, with
        no slot freed since: the need mask itself)."""
        unchanged = self.generations.unchanged_since(head.idx_np, head.freed_mark)
        if unchanged is None:
            return head.need_np, head.needed
        keep: np.ndarray = head.need_np & unchanged
        return keep, int(np.count_nonzero(keep))

    @records_errors
    def consume(self, draft_tokens_to_update: torch.Tensor | None = None) -> ReleasedStep | None:
        """Release the step posted D steps ago (non-last ranks).

        Returns None for an empty slot, or when every row is excluded (then it
        does not wait). Otherwise waits, at most timeout_s, for the transfer,
        checks the header against this rank's view (DesyncError), and scatters
        drafts into ``draft_tokens_to_update[slot]`` for kept rows only."""
        self._check_role(self.names.consume, last=False)
        # consume() again without a post() between: the step before had an empty
        # schedule, so its reserved tail stays an empty slot (no transfer on any
        # rank; a rank that posted where others did not is caught by the frame's
        # seq and digest).
        table = None
        if draft_tokens_to_update is not None:
            table = check_draft_target(
                draft_tokens_to_update,
                max_num_reqs=self.config.max_num_reqs,
                num_drafts=self.config.num_speculative_steps,
            )
        self._prune()
        if self.device_steps is not None:
            # an earlier step's verdict, read now that its event completed:
            # raised before the ring moves, so this consume can be retried
            self._judged(self.device_steps.judge_received)
        head = self.ring.advance()
        self._tail_open = True
        if head is None:
            return None
        keep, kept = self._keep(head)
        if kept == 0:
            # Nothing to hand out: do not wait, but keep the buffer alive and
            # the work watched until it completes.
            self._inflight.append((head.buf, head.work))
            if self.device_steps is not None and head.staging is not None:
                self.device_steps.reuse(head.staging)  # the receive never touches it
            self.recorder.consume(head.frame, self.steps, self.ring.advanced, None, 0, 0)
            return None
        wait_from_ns = time.monotonic_ns()
        if self.device_steps is not None:
            released = self._release_device(head, keep, table)
        else:
            if not ended_ok(head.work):
                self._wait(head.work, f"receive of frame {head.frame.seq}")
            try:
                released = release_host(self.codec, head, keep, kept, table, rank=self.rank)
            except DesyncError as e:
                raise self.failed(e) from None
            self.codec.recycle(head.buf)  # everything released was copied out
        self.recorder.consume(head.frame, self.steps, self.ring.advanced, keep, kept,
                              wait_from_ns)
        return released

    def _release_device(
        self, head: PendingStep, keep: np.ndarray, table: torch.Tensor | None
    ) -> ReleasedStep:
        """The device codec's consume: this step's bad verdict raises here
        when its event has completed (else at the next consume)."""
        steps, staging = self.device_steps, head.staging
        assert steps is not None and staging is not None
        what = f"receive of frame {head.frame.seq}"
        return self._judged(lambda: steps.release(
            head.frame, head.buf, staging, head.work, keep, head.idx_np, table,
            head.expect_drafts, lambda work: self._wait(work, what)))

    def _judged(self, call: Callable[[], T]) -> T:
        """``call()``, with a device verdict's error raised as the path's own:
        a DesyncError through the board; a BatchError (the last rank sent bad
        values) as it is, since every rank raises it from the frame itself
        (the board would rename the cause)."""
        try:
            return call()
        except DesyncError as e:
            raise self.failed(e) from None
        except BatchError as e:
            dump_on_error(self, e)
            raise

    # -- lifecycle ----------------------------------------------------------

    def close(self, *, drain: bool = True, reason: str | None = None) -> None:
        """Stop using the group. With ``drain``, wait (bounded) for every
        posted receive and issued send, so no peer is left mid-collective;
        without, abandon them. Further calls raise ProtocolError.

        Leaving with transfers abandoned, or with a ``reason`` (why this rank
        leaves mid-run, e.g. "its engine raised ..."), tells the peers on the
        board (:meth:`leave`) unless this rank already posted a failure."""
        if self._closed:
            return
        try:
            if drain:
                for pending in self.ring.pending():
                    self._wait(pending.work, f"draining receive of frame {pending.frame.seq}")
                while self._inflight:
                    _, work = self._inflight.popleft()
                    self._wait(work, "draining transfer")
                self.recorder.drained(self.steps)
                if self.device_steps is not None:
                    self._judge_all()
        finally:
            abandoned = any(not finished(s.work) for s in self.ring.pending()) or any(
                not finished(w) for _, w in self._inflight)
            self.ring.clear()
            self._inflight.clear()
            self._closed = True
            if abandoned:
                keep_until_exit(self.group)
            if abandoned or reason is not None:
                self.leave(reason or "closed with transfers in flight")

    def _judge_all(self) -> None:
        """After a drain: every verdict not yet read (device codec)."""
        steps = self.device_steps
        assert steps is not None
        if self.is_last:
            steps.judge_sent(all_=True)
        else:
            steps.judge_received(all_=True)

    @property
    def closed(self) -> bool:
        return self._closed

    def dump(self, path: str | Path | None = None) -> Path:
        """Write this path's flight record as JSON Lines (ppsync.schemas.dump)
        to ``path``, or with None to its file in the dump directory (see
        ppsync.core.dumps; ConfigError when none is set). Returns the file."""
        return write_dump(self, dump_file(self, path), reason="request")

