"""One rank's end of a token group: who is who in it, what its works mean
(the completion semantics), how its frames are issued and packed (the
transport and the codec), the start-up handshake, the transfers in flight
(the ring of posted receives, the sends held until they end), every bounded
wait on them, its watcher, its failures, its flight recorder, its close. It
knows no step protocol: :class:`~ppsync.core.path.token_path.TokenPath` adds the
need mask, the generations and the roles' calls on top.

Everything that depends on the codec is in the codec object
(ppsync.core.codec.protocol), chosen once: no branch here or in TokenPath asks
which codec it has.
"""
from __future__ import annotations

from collections.abc import Callable, Generator
from pathlib import Path
from typing import Literal, TypeVar

import torch
import torch.distributed as dist

from ppsync.core.codec import StepCodec, codec_for
from ppsync.core.codec.steps import PendingStep
from ppsync.core.path.failures import PathFailures
from ppsync.core.path.handshake import Handshake
from ppsync.core.path.names import TOKEN_PATH_NAMES, CallNames, role_error
from ppsync.core.path.ring import SlotRing
from ppsync.core.recorder.flight import FlightRecorder
from ppsync.core.recorder.on_error import dump_on_error
from ppsync.core.recorder.registry import dump_file, register
from ppsync.core.recorder.snapshot import write_dump
from ppsync.core.wire.board import FailureBoard
from ppsync.core.wire.completion import Completion, completion_for
from ppsync.core.wire.completion.semantics import aborted_error
from ppsync.core.wire.groups import group_facts
from ppsync.core.wire.platform import Platform, platform_for
from ppsync.core.wire.rank_watch import RankWatcher
from ppsync.core.wire.teardown import aborted_cause, keep_until_exit
from ppsync.core.wire.transport import Broadcaster, TransportClock
from ppsync.core.wire.waits import InFlight, Waits, slice_ended, wait_slices
from ppsync.errors import (
    BatchError,
    ConfigError,
    DesyncError,
    PPSyncError,
    ProtocolError,
    SyncTimeout,
)
from ppsync.schemas.config import SyncConfig

T = TypeVar("T")


class GroupEnd:
    """One rank's end of the token group ``group`` (the dedicated token
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
        ppsync.core.wire.board); "group" (the default): a board in the group's
        own store; None: no board, each rank reports only what it saw.
        ``names``: the caller's names for consume/post/publish, used in errors.
        ``device``: where the device codec's frames live (default CPU);
        ``platform``: cpu, cuda or xpu (default: the device's type)."""
        rank, size, group_ranks, backend = group_facts(group)
        if size != config.pp_size:
            raise ConfigError(
                f"pp_size = {config.pp_size} but the group has {size} ranks; they must match"
            )
        earlier = aborted_cause(group)
        if earlier is not None:
            raise ConfigError(f"group {group_ranks}: an earlier token path on it failed "
                              f"({earlier}); its transfers may still be pending: build the new "
                              "token path on a new group")
        self.config = config
        self.names = names
        self.group = group
        self.rank = rank
        self.is_last = self.rank == config.pp_size - 1
        self.group_ranks = group_ranks
        self.global_rank = group_ranks[rank]
        self.src = group_ranks[config.pp_size - 1]
        self.board = FailureBoard.of_group(group) if board == "group" else board
        self.completion: Completion = completion_for(group, backend)
        """What the group's works mean (host-completed: gloo; stream-ordered:
        NCCL, XCCL, the CPU twin): every wait and stream order asks it."""
        self.transport: Broadcaster = self.completion.broadcaster(group, config.pp_size - 1)
        """Issues each frame's collective (``issue(buf) -> Work``); a benchmark
        may put a loopback in its place (ppsync.bench.loopback)."""
        self.platform = self.completion.platform(
            platform if isinstance(platform, Platform) else platform_for(device, platform))
        self.backend = backend
        self.completion.bind(group, config.max_pending_s, self.platform)
        self.failures = PathFailures(group, rank=rank, board=self.board,
                                     completion=self.completion)
        """Names, aborts and tells this path's failures (ppsync.core.path.failures)."""
        self.ring: SlotRing[PendingStep] = SlotRing(config.depth)
        self.seq = 0  # frames issued on this group so far
        self.steps = 0  # post/publish calls so far (the subclass's steps)
        self._inflight = InFlight(config.depth)
        self._closed = self._serving = False  # serving: its codec is built (after its watcher)
        self._last_issued: tuple[int, dist.Work] | None = None
        self.handshake: Handshake | None = None
        self.on_tick: Callable[[], None] | None = None
        """Called by the watcher each round while no engine call runs (the
        vLLM adapter sends a step it held for drafts that did not come)."""
        self._others = others = [r for r in group_ranks if r != self.global_rank]
        self.watcher = RankWatcher(self, board=self.board, me=self.global_rank,
                                   ranks=group_ranks, peers=others if self.is_last else [self.src],
                                   completion=self.completion, platform=self.platform,
                                   silent_s=config.silent_s, max_pending_s=config.max_pending_s)
        """This rank's one watcher thread (ppsync.core.wire.rank_watch): its
        heartbeat, its peers' liveness, failures found off the engine's thread."""
        self.failures.peers = self.watcher.peer_view
        self._waits = Waits(self.rank, config.timeout_s,
                            lambda err, observed: self.failed(err, observed=observed),
                            self.completion, watch=self.watcher, peers=self.watcher.peers)
        self.recorder = FlightRecorder(config.flight_events, is_last=self.is_last,
                                       depth=config.depth)
        """This path's flight recorder (ppsync.core.recorder.flight); see :meth:`dump`."""
        self.dump_inline = True
        """Write an error's dump in the failing call (True), or hand it to
        the dump writer thread (False: an event loop's thread never writes
        one; ppsync.core.recorder.writer.flush_dumps waits for it)."""
        # alive and arrived before the codec's warm-up (a rank compiling its
        # kernels for minutes is starting, not absent)
        if self.board is not None:
            self.board.arrive("handshake")
        self.watcher.starting("building its codec")
        self.watcher.start()
        try:
            # chosen before the handshake: a codec the backend cannot carry
            # raises before anything is issued
            self.codec: StepCodec = codec_for(
                config, self.platform, completion=self.completion, backend=backend,
                rank=self.rank, src=self.src)
            """Packs, checks and releases this path's frames (ppsync.core.codec.protocol)."""
            self.codec.on_deferred(self.watcher.poke)
            self._serving = True
            self.watcher.starting("configuration handshake")
            # beating before joining: a peer that reads this rank's beat after
            # the handshake knows it is this run's (ppsync.core.wire.heartbeat)
            if self.board is not None:
                self.watcher.first_beat.wait(self.board.op_timeout_s)
            self.handshake = Handshake(
                config, group, rank=self.rank, completion=self.completion,
                codec=self.codec,
                device=self.platform.device if self.completion.device_only else None)
            """Issued at once; finished here, or by the caller (``wait_handshake``
            False: an event loop awaits :meth:`handshake_work` under
            :meth:`handshake_slices`, then calls finish_handshake)."""
        except BaseException:
            self.watcher.stop()
            raise
        self.run_id = 0  # agreed by every rank at the handshake; scopes the failure board
        register(self)
        if wait_handshake:
            self.finish_handshake()

    def finish_handshake(self) -> None:
        """Check the start-up handshake (DesyncError if any rank's
        configuration differs) and bind the board to the agreed run id.
        Every other call needs it done."""
        if self.handshake is None:
            return
        try:
            for slice_s in self.handshake_slices():
                try:
                    self.completion.wait(self.handshake.work, timeout_s=slice_s,
                                         what=f"rank {self.rank}: configuration handshake",
                                         peer=None)
                    break
                except SyncTimeout as err:
                    if slice_ended(self.completion, self.handshake.work, err):
                        break
            self.run_id = self.handshake.finish()
        except SyncTimeout as e:
            self.watcher.stop()
            raise self.handshake_error(e) from None
        except BaseException:
            self.watcher.stop()
            raise
        self.handshake = None
        self.watcher.starting(None)
        self.watcher.peer_view.joined()
        if self.board is not None:
            self.board.bind_run(self.run_id)

    def handshake_slices(self) -> Generator[float, None, None]:
        """The slices of the wait for the start-up handshake (an event loop
        awaits :meth:`handshake_work` through them): past ``timeout_s`` it
        ends only if a rank of the group is not alive (never seen beating,
        or silent: then ``never_arrived`` names the absent ones); a rank
        that beats is starting (compiling its kernels, loading a model) and
        is waited for, with a log line at growing intervals."""
        what, others = f"rank {self.rank}: configuration handshake", self._others
        view = self.watcher.peer_view
        return wait_slices(what, timeout_s=self.config.timeout_s, watch=self.watcher,
                           peers=others,
                           keep_waiting=lambda: self.board is not None and all(
                               view.alive(r) for r in others))

    @property
    def clock(self) -> TransportClock | None:
        """Collects the CPU time of issues and real waits, when set (a bench's)."""
        return self._waits.clock

    @clock.setter
    def clock(self, clock: TransportClock | None) -> None:
        self._waits.clock = clock

    def _issue(self, buf: torch.Tensor) -> dist.Work:
        clock = self._waits.clock
        return (self.transport.issue(buf) if clock is None
                else clock.timed_issue(self.transport.issue, buf))

    # -- the async contract (ppsync.core.path.token_path) -----------------------

    def handshake_work(self) -> dist.Work | None:
        """The handshake's collective while :meth:`finish_handshake` is due."""
        return None if self.handshake is None else self.handshake.work

    def works_before_issue(self) -> list[dist.Work]:
        """Works that the next send/consume would wait on synchronously (the
        oldest beyond D in flight); an async caller awaits these first so the
        call never blocks."""
        return self._inflight.before_issue()

    def last_issued(self) -> tuple[int, dist.Work] | None:
        """(seq, work) of the most recent collective issued; None before one."""
        return self._last_issued

    def _check_open(self) -> None:
        if self._closed:
            raise ProtocolError(f"rank {self.rank}: token path used after close()")
        final = self.failures.final
        if final is not None:  # a failed path: nothing of its group is used again
            if not self.failures.told:  # found off this thread (its watcher)
                raise self.failed(final)
            raise aborted_error(final, f"rank {self.rank}: token path used")
        if self.handshake is not None:
            raise ProtocolError(f"rank {self.rank}: token path used before its start-up "
                                "handshake finished (finish_handshake())")
        self.codec.pump()  # every call first sends the frames whose copies ended

    def require_role(self, op: str, *, last: bool) -> None:
        """Raise RoleError unless this rank is (``last``) or is not the last
        rank; ProtocolError after close(). For adapters checking first."""
        self._check_open()
        if self.is_last != last:
            raise role_error(op, rank=self.rank, pp_size=self.config.pp_size, last=last)

    def _prune(self) -> None:
        """Drop completed works; wait the oldest while more than D are held."""
        self._inflight.prune(self._waits, self._completed)

    def _completed(self, buf: torch.Tensor, work: dist.Work) -> None:
        self.recorder.complete(work, self.steps)
        self.codec.reuse(buf)

    def failed(
        self, err: PPSyncError, *, settle: bool = True, observed: bool = True,
        dump: bool = True,
    ) -> PPSyncError:
        """The error to raise for ``err`` (:meth:`PathFailures.named
        <ppsync.core.path.failures.PathFailures.named>`). With ``dump`` the error
        is recorded and, with a dump directory, dumped; a note on it names
        the file (False: a caller that asks again once the others posted,
        and dumps that answer only)."""
        named = self.failures.named(err, settle=settle, observed=observed)
        if dump:
            self.failures.told = self.failures.told or named is self.failures.final
            dump_on_error(self, named)
        return named

    # -- what the watcher watches (ppsync.core.wire.rank_watch.Watched) --------

    def outstanding(self) -> list[dist.Work]:
        """The works issued and not yet released, as a snapshot: the ring's
        posted receives, the transfers kept in flight, the handshake's."""
        try:
            works = [p.work for p in self.ring.pending() if p is not None]
            works += self._inflight.works()
        except RuntimeError:  # the engine's thread changed them meanwhile: next round
            return []
        shake = self.handshake
        if shake is not None:
            works.append(shake.work)
        return works

    def step_count(self) -> int:
        return self.steps

    def fail_in_background(self, err: PPSyncError, observed: bool) -> PPSyncError:
        """Fail the path for what its watcher found (the engine's next call,
        or its current wait, raises it); no dump here: the engine's thread
        records it when raised, or the watcher's ``on_failure`` does."""
        return self.failures.named(err, settle=True, observed=observed)

    def failure(self) -> PPSyncError | None:
        return self.failures.final

    def tick(self) -> None:
        if self._closed or not self._serving:
            return
        self.codec.pump()  # a frame goes even when the engine makes no further call
        if self.on_tick is not None:
            self.on_tick()

    def hurry(self) -> bool:
        return self._serving and not self._closed and self.codec.hurry()

    def handshake_error(self, err: SyncTimeout) -> SyncTimeout:
        """The start-up handshake's timeout as raised (an event loop's
        wait): see :meth:`PathFailures.handshake_error
        <ppsync.core.path.failures.PathFailures.handshake_error>`."""
        return self.failures.handshake_error(err)

    def _checked(self, call: Callable[..., T], *args: object) -> T:
        """``call()``, with a frame check's error raised as the path's own:
        a DesyncError through the board; a BatchError (the last rank sent bad
        values, found on the device) as it is, since every rank raises it
        from the frame itself (the board would rename the cause)."""
        try:
            return call(*args)
        except DesyncError as e:
            raise self.failed(e) from None
        except BatchError as e:
            dump_on_error(self, e)
            raise

    def _issued(self, work: dist.Work) -> None:
        self._last_issued = (self.seq, work)
        self.seq += 1

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
            # an aborted group's buffers are never drained nor checked: the
            # abort's cause was raised already
            if drain and self.failures.final is None:
                for pending in self.ring.pending():
                    self._waits.wait(pending.work,
                                     f"draining receive of frame {pending.frame.seq}")
                self.codec.pump(wait=True)  # the last frames' copies, then their sends
                self._inflight.drain(self._waits)
                self.recorder.drained(self.steps)
                self._checked(self.codec.settle, True)
        finally:
            ends = self.completion
            abandoned = (any(not ends.ended(s.work) for s in self.ring.pending())
                         or self._inflight.abandoned(ends))
            self.ring.clear()
            self._inflight.clear()
            self._closed = True
            self.watcher.stop()
            if abandoned:  # stream-ordered: no stream waits on them forever
                self.failures.abort(ProtocolError(
                    f"rank {self.rank}: the token path was closed with transfers in flight"))
            if abandoned or self.completion.cause is not None:
                # works that an abort ended may still be pending underneath
                # (the CPU twin's gloo): the group is never destroyed
                keep_until_exit(self.group)
            self.codec.close()
            if abandoned or reason is not None:
                self.failures.leave(reason or "closed with transfers in flight")
            if self.board is not None:
                self.board.rest()

    @property
    def closed(self) -> bool:
        return self._closed

    def dump(self, path: str | Path | None = None) -> Path:
        """Write this path's flight record as JSON Lines (ppsync.schemas.dump)
        to ``path``, or with None to its file in the dump directory (see
        ppsync.core.recorder.registry; ConfigError when none is set). Returns the file."""
        return write_dump(self, dump_file(self, path), reason="request")
