"""One SGLang scheduler's guard: its views of the PP messages, its bounded
waits, and the one error it raises for a failure, named and dumped.

A guard belongs to one PP stage (one scheduler process). It counts the
messages of each kind it sends and receives (:meth:`SglangGuard.stamp`,
:meth:`SglangGuard.check`), waits on gloo transfers with a deadline
(:meth:`SglangGuard.wait`), and turns any
failure into the board's verdict (ppsync.core.wire.board): the same error
type on every stage for one cause, naming the culprit as SGLang's PP stage
and global rank. The error is recorded in the guard's flight recorder and
dumped (ppsync.core.recorder.on_error) where ``PPSYNC_DUMP_DIR`` is set.

The guard is a :class:`ppsync.core.recorder.registry.Dumpable`: a dump shows each
message as an event (``publish``: sent, ``post``: received; ``step``: the
message's number on its channel; ``num_reqs``: its batch size).
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from dataclasses import dataclass

import torch.distributed as dist

from ppsync.compat.sglang.digest import KINDS, Batch, StepView, check_views, view_of
from ppsync.core.recorder.flight import FlightRecorder
from ppsync.core.recorder.on_error import dump_on_error
from ppsync.core.recorder.registry import register
from ppsync.core.wire.board import FailureBoard
from ppsync.core.wire.transport import wait_work
from ppsync.core.wire.waits import named_failure
from ppsync.errors import ConfigError, DesyncError, PeerLost, PPSyncError, SyncTimeout
from ppsync.schemas.config import DEFAULT_TIMEOUT_S, SyncConfig

__all__ = ["ENV_CHECK", "ENV_PERTURB", "ENV_TIMEOUT", "GuardOptions", "Perturb", "SglangGuard"]

ENV_TIMEOUT = "PPSYNC_TIMEOUT_S"
"""Bound on every PP receive (and send wait) of a guarded stage, seconds."""
ENV_CHECK = "PPSYNC_SGLANG_CHECK"
"""``0``: the receiver does not compare the views (a test switch: the
desync test must fail without the check); anything else or unset: it does."""
ENV_PERTURB = "PPSYNC_SGLANG_PERTURB"
"""A test hook, ``STAGE:KIND:STEP``: stage STAGE's own view of message STEP
of KIND (``proxy`` or ``output``) is perturbed (its ``rids`` field), as if
that stage had built another batch. Changes nothing SGLang computes."""
_FLIGHT_EVENTS = 4096


@dataclass(frozen=True)
class Perturb:
    """Where :data:`ENV_PERTURB` perturbs a stage's own view."""

    stage: int
    kind: str
    step: int

    @classmethod
    def parse(cls, text: str) -> Perturb:
        parts = text.split(":")
        rule = "must be STAGE:KIND:STEP, KIND one of proxy, output, STAGE and STEP >= 0"
        if len(parts) != 3 or parts[1] not in KINDS:
            raise ConfigError(f"{ENV_PERTURB} = {text!r} {rule}")
        try:
            stage, step = int(parts[0]), int(parts[2])
        except ValueError:
            raise ConfigError(f"{ENV_PERTURB} = {text!r} {rule}") from None
        if stage < 0 or step < 0:
            raise ConfigError(f"{ENV_PERTURB} = {text!r} {rule}")
        return cls(stage, parts[1], step)


@dataclass(frozen=True)
class GuardOptions:
    """A guard's settings, read from the environment once per process."""

    timeout_s: float = DEFAULT_TIMEOUT_S
    check: bool = True
    perturb: Perturb | None = None

    @classmethod
    def from_env(cls) -> GuardOptions:
        """The options the variables give; ConfigError naming a bad one."""
        raw = os.environ.get(ENV_TIMEOUT)
        timeout_s = DEFAULT_TIMEOUT_S
        if raw is not None:
            try:
                timeout_s = float(raw)
            except ValueError:
                timeout_s = -1.0
            if not 0 < timeout_s <= 86400:
                raise ConfigError(f"{ENV_TIMEOUT} = {raw!r} must be a number of seconds in "
                                  "(0, 86400]")
        perturb = os.environ.get(ENV_PERTURB)
        return cls(timeout_s=timeout_s, check=os.environ.get(ENV_CHECK) != "0",
                   perturb=Perturb.parse(perturb) if perturb else None)


class SglangGuard:
    """The guard of PP stage ``stage`` of ``pp_size``; ``group`` is SGLang's
    gloo PP group (its store holds the failure board)."""

    dump_inline = True  # a scheduler waits synchronously: its dumps are written at once

    def __init__(self, *, stage: int, pp_size: int, group: dist.ProcessGroup,
                 options: GuardOptions) -> None:
        self.stage = stage
        self.options = options
        self.group_ranks_: list[int] = dist.get_process_group_ranks(group)
        self.global_rank_ = dist.get_rank()
        self.board = FailureBoard.of_group(group)
        self.config = SyncConfig(pp_size=pp_size, max_num_reqs=1,
                                 timeout_s=options.timeout_s)
        self.rank = stage
        self.recorder = FlightRecorder(_FLIGHT_EVENTS, is_last=False, depth=1)
        self.steps = 0  # messages sent and received
        self.seq = 0
        self.run_id = 0
        self._sent = [0] * len(KINDS)
        self._received = [0] * len(KINDS)
        self._failure: PPSyncError | None = None
        self._peer: int | None = None  # the global rank of the transfer waited on last
        register(self)

    # -- what a dump reads (ppsync.core.recorder.registry.Dumpable) -----------------------

    @property
    def global_rank(self) -> int:
        return self.global_rank_

    @property
    def group_ranks(self) -> list[int]:
        return self.group_ranks_

    @property
    def closed(self) -> bool:
        return self._failure is not None

    # -- the views --------------------------------------------------------------

    def stage_of(self, global_rank: int) -> int:
        """SGLang's PP stage of ``global_rank`` (-1: not in the PP group)."""
        ranks = self.group_ranks_
        return ranks.index(global_rank) if global_rank in ranks else -1

    @property
    def prev_stage(self) -> int:
        return (self.stage - 1) % len(self.group_ranks_)

    @property
    def next_stage(self) -> int:
        return (self.stage + 1) % len(self.group_ranks_)

    def stamp(self, kind: str, batch: Batch | None,
              relayed: StepView | None = None) -> tuple[int, ...]:
        """This stage's view of the next message of ``kind`` it sends, as it
        travels: ``batch``'s, or (a stage relaying what it received) the
        view it received the message with, renumbered on this channel."""
        k = KINDS.index(kind)
        view = (view_of(batch, kind, self._sent[k]) if relayed is None
                else dataclasses.replace(relayed, step=self._sent[k]))
        self._sent[k] += 1
        self.steps += 1
        self.recorder.call(True, view.step, 1, view.num_reqs)
        return view.as_tuple()

    def own_view(self, kind: str, batch: Batch | None) -> StepView:
        """This stage's view of the next message of ``kind`` it receives
        (perturbed where :data:`ENV_PERTURB` says)."""
        k = KINDS.index(kind)
        view = view_of(batch, kind, self._received[k])
        self._received[k] += 1
        self.steps += 1
        self.recorder.call(False, view.step, 1, view.num_reqs)
        p = self.options.perturb
        if p is not None and (p.stage, p.kind, p.step) == (self.stage, kind, view.step):
            view = StepView(*(v ^ 1 if i == 3 else v for i, v in enumerate(view.as_tuple())))
        return view

    def check(self, kind: str, batch: Batch | None, carried: object) -> StepView:
        """Compare this stage's view of a received message of ``kind`` with
        the one it ``carried``; raise the named DesyncError (posted on the
        board, dumped) at the first differing field. Returns this stage's view."""
        mine = self.own_view(kind, batch)
        if not self.options.check:
            return mine
        try:
            theirs = StepView.from_tuple(carried)
            check_views(mine, theirs, stage=self.stage, sender=self.prev_stage)
        except DesyncError as e:
            raise self.failed(e, True) from None
        return mine

    # -- waits and failures -----------------------------------------------------

    def wait(self, work: dist.Work, what: str, peer: int) -> None:
        """Wait for gloo ``work`` (a transfer with global rank ``peer``) at
        most the timeout; raise the named failure.

        One wait, not slices against the board: a gloo send or receive
        whose wait times out signals the timeout to every pair of the
        group's context, which closes them all, so a wait may time out
        only at the deadline. The board is read when the wait ends: at the
        deadline, or at once when the peer's connection closes."""
        self._peer = peer
        try:
            wait_work(work, timeout_s=self.options.timeout_s, what=what, peer=peer)
        except PPSyncError as e:
            raise self.failed(e, True) from e

    def failed(self, err: PPSyncError, observed: bool) -> PPSyncError:
        """The error to raise for ``err`` (``observed``: seen here, not only
        read on the board): the board's verdict, with the culprit named as
        SGLang's stage and global rank, recorded and dumped. The first
        failure is the guard's last: later calls return it again."""
        if self._failure is not None:
            return self._failure
        verdict = named_failure(err, self.board, rank=self.global_rank_, settle=True,
                                observed=observed)
        named = self._named(verdict)
        self._failure = named
        if isinstance(named, DesyncError) and observed and self.board is not None:
            # let the other stages read it on the board and raise it too
            # before this one's exit ends the engine (every stage names it)
            deadline = time.monotonic() + self.board.grace_s
            while self.board.missing() and time.monotonic() < deadline:
                time.sleep(0.05)
        dump_on_error(self, named)
        print(f"ppsync: SGLang PP stage {self.stage} (global rank {self.global_rank_}): "
              f"{type(named).__name__}: {named}", file=sys.stderr, flush=True)
        return named

    def _named(self, err: PPSyncError) -> PPSyncError:
        me = f"SGLang PP stage {self.stage} (global rank {self.global_rank_})"
        if isinstance(err, DesyncError):
            text = str(err)
            found = text.rfind("SGLang PP stage")  # the detecting stage's words, once relayed
            if found == 0:
                return err
            told = text[found:] if found > 0 else text
            return DesyncError(f"{me}: another stage found: {told}", expected=err.expected,
                               received=err.received)
        peer = getattr(err, "peer", None)
        if peer is None:  # the board named nobody: the peer of the transfer that failed
            peer = self._peer
        if not isinstance(err, (PeerLost, SyncTimeout)) or peer is None:
            return type(err)(f"{me}: {err}")
        culprit = f"PP stage {self.stage_of(peer)} (global rank {peer})"
        if isinstance(err, PeerLost):
            return PeerLost(f"{me}: {culprit} is lost: {err}", peer=peer)
        return SyncTimeout(f"{me}: {culprit} is silent: {err}", peer=peer)
