"""One SGLang scheduler's guard: its views of the PP messages, its bounded
waits, and the one error it raises for a failure, named and dumped.

A guard belongs to one PP stage (one scheduler process). It counts the
messages of each kind it sends and receives (:meth:`SglangGuard.stamp`,
:meth:`SglangGuard.check`), waits on gloo transfers with a bound counted
from the wait's start (:meth:`SglangGuard.wait`), and turns any failure
into the board's verdict (ppsync.core.wire.board): the same error type on
every stage for one cause, naming the culprit as SGLang's PP stage and
global rank. The error is recorded in the guard's flight recorder and
dumped (ppsync.core.recorder.on_error) where ``PPSYNC_DUMP_DIR`` is set.

Slow is not dead (docs/design.md): a stage's watcher thread
(ppsync.core.wire.rank_watch) publishes its heartbeat on the board and
reads its peers'. A stage slow in its own step is alive and waited for, up
to ``timeout_s`` per wait (SGLang's own watchdog is 300 s by default, its
PP group's timeout 30 minutes); a stage whose heartbeat stops for
``silent_s`` is named silent by every stage that waits, within about a
second more. A scheduler blocked in a gloo wait cannot be interrupted (a
gloo send or receive whose wait times out closes every connection of the
group), so the watcher then ends the stage's process itself, after naming
the silent stage, posting it and dumping: SGLang ends the server as it does
for any scheduler that dies.

The guard is a :class:`ppsync.core.recorder.registry.Dumpable`: a dump shows each
message as an event (``publish``: sent, ``post``: received; ``step``: the
message's number on its channel; ``num_reqs``: its batch size).
"""

from __future__ import annotations

import dataclasses
import os
import sys
import threading
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ppsync.compat.env import ENV_SILENT, ENV_TIMEOUT, bounds_from_env
from ppsync.compat.sglang.digest import KINDS, Batch, StepView, check_views, view_of
from ppsync.core.recorder.flight import FlightRecorder
from ppsync.core.recorder.on_error import dump_on_error
from ppsync.core.recorder.registry import register
from ppsync.core.wire.board import FailureBoard
from ppsync.core.wire.completion import HostCompleted
from ppsync.core.wire.platform import Platform
from ppsync.core.wire.rank_watch import RankWatcher
from ppsync.core.wire.teardown import end_now
from ppsync.core.wire.transport import wait_work
from ppsync.core.wire.waits import named_failure
from ppsync.errors import ConfigError, DesyncError, PeerLost, PPSyncError, SyncTimeout
from ppsync.schemas.config import DEFAULT_SILENT_S, DEFAULT_TIMEOUT_S, SyncConfig

__all__ = ["ENV_CHECK", "ENV_PERTURB", "ENV_SILENT", "ENV_TIMEOUT", "EXIT_STATUS",
           "GuardOptions", "Perturb", "SglangGuard"]

EXIT_STATUS = 70
"""A stage's exit status when its watcher ends it on a failure (a peer
stage silent or lost while this one is blocked in a gloo wait)."""
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
    silent_s: float = DEFAULT_SILENT_S
    check: bool = True
    perturb: Perturb | None = None

    @classmethod
    def from_env(cls) -> GuardOptions:
        """The options the variables give; ConfigError naming a bad one
        (``PPSYNC_TIMEOUT_S`` and ``PPSYNC_SILENT_S`` read as the vLLM
        plugin reads them: ppsync.compat.env)."""
        bounds = bounds_from_env(os.environ)
        perturb = os.environ.get(ENV_PERTURB)
        return cls(timeout_s=bounds.timeout_s, silent_s=bounds.silent_s,
                   check=os.environ.get(ENV_CHECK) != "0",
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
                                 timeout_s=options.timeout_s, silent_s=options.silent_s,
                                 max_pending_s=max(options.timeout_s, 86400.0))
        self.rank = stage
        self.recorder = FlightRecorder(_FLIGHT_EVENTS, is_last=False, depth=1)
        self.steps = 0  # messages sent and received
        self.seq = 0
        self.run_id = 0
        self._sent = [0] * len(KINDS)
        self._received = [0] * len(KINDS)
        self._failure: PPSyncError | None = None
        self._peer: int | None = None  # the global rank of the transfer waited on last
        self._lock = threading.Lock()  # the scheduler's thread and the watcher's
        self._waiting: list[dist.Work] = []
        ranks = self.group_ranks_
        self.watcher = RankWatcher(
            self, board=self.board, me=self.global_rank_, ranks=ranks,
            peers=[ranks[self.prev_stage], ranks[self.next_stage]],
            completion=HostCompleted(), platform=Platform(torch.device("cpu")),
            silent_s=options.silent_s, max_pending_s=self.config.max_pending_s)
        """The stage's watcher thread: its heartbeat, its peers' liveness."""
        # made at the first PP message, once SGLang's PP group is up on every
        # stage: a beat read from now on is this run's
        self.watcher.peer_view.joined()
        self.watcher.on_failure = self._end_stage
        self.watcher.start()
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
            raise self._raised(e) from None
        return mine

    def _raised(self, err: PPSyncError) -> PPSyncError:
        """The named failure for ``err``, raised to the scheduler by its own
        call: the watcher, which ends the stage only for a failure the
        scheduler cannot be told of (a wait it cannot leave), must not act
        on it too, while it is named or after."""
        with self.watcher.engine_call():
            named = self.failed(err, True)
            self.watcher.act_once(lambda: None)
        return named

    # -- waits and failures -----------------------------------------------------

    def wait(self, work: dist.Work, what: str, peer: int) -> None:
        """Wait for gloo ``work`` (a transfer with global rank ``peer``) at
        most the timeout from now; raise the named failure.

        One wait, not slices: a gloo send or receive whose wait times out
        signals the timeout to every pair of the group's context, which
        closes them all, so a wait may time out only at its bound. The
        board is read when the wait ends: at the bound, or at once when the
        peer's connection closes; meanwhile the watcher names a silent
        stage and ends this one (:meth:`_end_stage`)."""
        self._peer = peer
        with self._lock:
            self._waiting.append(work)
        token = self.watcher.begin(what)
        try:
            wait_work(work, timeout_s=self.options.timeout_s, what=what, peer=peer)
        except PPSyncError as e:
            raise self._raised(e) from e
        finally:
            self.watcher.end(token)
            with self._lock:
                self._waiting.remove(work)

    # -- what the watcher watches (ppsync.core.wire.rank_watch.Watched) ---------------

    def outstanding(self) -> list[dist.Work]:
        with self._lock:
            return list(self._waiting)

    def step_count(self) -> int:
        return self.steps

    def fail_in_background(self, err: PPSyncError, observed: bool) -> PPSyncError:
        return self.failed(err, observed)

    def failure(self) -> PPSyncError | None:
        return self._failure

    def tick(self) -> None:
        """Nothing to do between rounds."""

    def hurry(self) -> bool:
        return False

    def _end_stage(self, err: PPSyncError) -> None:
        """The watcher found a failure while this stage's scheduler is blocked
        in a gloo wait it cannot leave: end the stage (named, posted and
        dumped already by :meth:`failed`)."""
        print(f"ppsync: SGLang PP stage {self.stage} (global rank {self.global_rank_}): "
              f"ending this stage (status {EXIT_STATUS}): its scheduler waits in a gloo "
              f"transfer that will not end: {type(err).__name__}", file=sys.stderr, flush=True)
        end_now(EXIT_STATUS)

    def failed(self, err: PPSyncError, observed: bool) -> PPSyncError:
        """The error to raise for ``err`` (``observed``: seen here, not only
        read on the board): the board's verdict, with the culprit named as
        SGLang's stage and global rank, recorded and dumped. The first
        failure is the guard's last: later calls return it again (from the
        scheduler's thread or the watcher's)."""
        with self._lock:
            if self._failure is not None:
                return self._failure
            return self._failed(err, observed)

    def _failed(self, err: PPSyncError, observed: bool) -> PPSyncError:
        verdict = named_failure(err, self.board, rank=self.global_rank_, settle=True,
                                observed=observed, peers=self.watcher.peer_view)
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
        if self.watcher.peer_view.alive(peer):  # it beats: slow or stuck, not silent
            return SyncTimeout(f"{me}: {culprit} is alive but made no progress: {err}",
                               peer=peer)
        return SyncTimeout(f"{me}: {culprit} is silent: {err}", peer=peer)
