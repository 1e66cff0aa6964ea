"""Run ranks as local processes on 127.0.0.1, joined in one gloo world.

Two ways, one machinery: :func:`spawn_world` sets torchrun's environment in
each child and calls a target that joins the world itself (``ppsync launch``
runs the rank code of ``ppsync run`` this way); :func:`spawn_ranks` joins the
world for its target (the benchmarks and the multi-process tests). Every wait
is bounded: a rank that does not report within ``timeout_s`` gets the whole
run killed and a :class:`SyncTimeout`, never an endless hang; with a
:class:`~ppsync.harness.step_board.StepBoard` (``ppsync launch``) the bound
is on progress instead: a rank that completes no step for ``stall_s`` is
ended as stuck, and a run that keeps stepping runs to its end; once a rank has
failed, the others get a grace (``failed_grace_s``) to fail or finish and are
then ended. SIGTERM or SIGINT to the launcher is passed on to every rank and
the store process, which are killed after :data:`STOP_GRACE_S`
(:class:`~ppsync.errors.Stopped`); every child also ends when the launcher
dies (ppsync.harness.lifetime).
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import multiprocessing as mp
import os
import signal
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any, Generic, TypeVar

import torch.distributed as dist
from torch._C._distributed_c10d import PrefixStore, Store, TCPStore

from ppsync.core.recorder.triggers import dump_all, install_dump_triggers
from ppsync.core.wire.board import FailureBoard
from ppsync.errors import PeerLost, RankFailed, Stopped, SyncTimeout
from ppsync.harness.lifetime import (
    StopGuard,
    default_stop_signals,
    die_with_parent,
    on_stop_signals,
    set_process_name,
)
from ppsync.harness.step_board import StallWatch, StepBoard, claim
from ppsync.harness.world import WorldEnv

R = TypeVar("R")

STOP_GRACE_S = 3.0
"""How long ranks and the store get to end after the launcher passed on a
SIGTERM / SIGINT, before they are killed."""


@dataclass(frozen=True, slots=True)
class RankEnv:
    """What a rank process knows when its target starts: the world is up.

    ``store`` is a client of the run's store, which the parent process hosts,
    so it outlives any rank (a failure board can live there)."""

    rank: int
    world_size: int
    timeout_s: float
    store: Store

    def failure_board(self, group: dist.ProcessGroup) -> FailureBoard:
        """A failure board for ``group`` in the run's store."""
        ranks = dist.get_process_group_ranks(group)
        return FailureBoard(self.store, ranks=ranks, me=self.rank)


@dataclass(frozen=True, slots=True)
class _Job(Generic[R]):
    target: Callable[[RankEnv], R] | Callable[[WorldEnv], R]
    rank: int
    world_size: int
    port: int
    timeout_s: float
    env: dict[str, str]
    joins_itself: bool  # the target joins the world from the environment (spawn_world)
    parent_pid: int  # the launcher: this rank ends when it does
    board: StepBoard | None  # this rank notes its steps there (spawn_world's runs)


def _world_environ(rank: int, world_size: int, port: int) -> dict[str, str]:
    """torchrun's variables for a local rank; the launcher's store process
    hosts the store, as torchrun's agent does."""
    return {
        "RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
        "TORCHELASTIC_USE_AGENT_STORE": "True",
    }


def _call(job: _Job[R]) -> R:
    if job.joins_itself:
        os.environ.update(_world_environ(job.rank, job.world_size, job.port))
        world = WorldEnv.from_environ(os.environ)
        return job.target(world)  # type: ignore[arg-type]
    timeout = datetime.timedelta(seconds=job.timeout_s)
    store = TCPStore("127.0.0.1", job.port, is_master=False, timeout=timeout)
    dist.init_process_group(
        "gloo",
        store=PrefixStore("world", store),
        rank=job.rank,
        world_size=job.world_size,
        timeout=timeout,
    )
    return job.target(RankEnv(job.rank, job.world_size, job.timeout_s, store))  # type: ignore[arg-type]


def _child(job: _Job[R], conn: Connection) -> None:
    """Body of a rank process. Leaves with os._exit so that gloo's threads
    cannot abort the process at interpreter exit after a failed collective."""
    code = 0
    default_stop_signals()
    die_with_parent(job.parent_pid)
    # Objects inherited by fork belong to the parent; this process's gc must not
    # free them (a parent TCPStore freed here waits on a thread this process lacks).
    gc.freeze()
    try:
        os.environ.update(job.env)
        # a stuck rank prints every thread's stack on SIGUSR1 (see _dump_stacks),
        # to fd 2 itself (sys.stderr may be a capture without a file descriptor),
        # and with a dump directory ($PPSYNC_DUMP_DIR) dumps its flight record
        install_dump_triggers(None)
        if job.board is not None:
            claim(job.board, job.rank)
        on_stop_signals(_stopped_rank)
        result = _call(job)
        conn.send(("ok", result))
    except Exception as e:  # reported to the parent, which re-raises
        code = 1
        try:
            conn.send(("err", e))
        except Exception:
            conn.send(("err", RuntimeError(traceback.format_exc())))
    finally:
        conn.close()
        dump_all("exit")  # os._exit skips atexit; no-op without a dump directory
        os._exit(code)


def _stopped_rank(signum: int, frame: object) -> None:
    """A rank told to stop (the launcher passes SIGTERM / SIGINT on): dump the
    flight record (no-op without a dump directory) and end."""
    dump_all("signal", error=Stopped(f"stopped by {signal.Signals(signum).name}", signum))
    os._exit(128 + signum)


def _store_host(timeout_s: float, conn: Connection, parent_pid: int) -> None:
    """Body of the store process: serve until killed or the launcher is gone."""
    try:
        default_stop_signals()
        die_with_parent(parent_pid)
        set_process_name("ppsync store")
        store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=timeout_s))
        conn.send(store.port)
        conn.close()
        while True:  # die_with_parent's watch ends the process
            time.sleep(3600)
    finally:
        os._exit(0)


def _start_store_host(ctx: Any, timeout_s: float) -> tuple[mp.process.BaseProcess, int]:
    """Start the run's store in a process of its own; return it and its port."""
    parent_end, child_end = ctx.Pipe(duplex=False)
    host = ctx.Process(target=_store_host, args=(timeout_s, child_end, os.getpid()),
                       daemon=True)
    host.start()
    child_end.close()
    if not parent_end.poll(timeout_s):
        host.kill()
        raise SyncTimeout(f"the store process did not start within {timeout_s} s")
    port: int = parent_end.recv()
    parent_end.close()
    return host, port


def _dump_stacks(procs: list[mp.process.BaseProcess]) -> None:
    """Ask stuck ranks to print their threads' stacks (to their stderr) and,
    with a dump directory, to dump their flight records, before they are
    killed, so a hang leaves a trace (``spawn_world``: when asked for)."""
    for p in procs:
        if p.pid is not None and p.is_alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, signal.SIGUSR1)
    time.sleep(0.5)


def spawn_world(
    target: Callable[[WorldEnv], R],
    world_size: int,
    *,
    timeout_s: float = 60.0,
    start_method: str = "fork",
    env: dict[str, str] | None = None,
    failed_grace_s: float | None = None,
    board: StepBoard | None = None,
    stall_s: float = 60.0,
    setup_s: float = 120.0,
    stacks: bool = False,
) -> list[R]:
    """Run ``target(WorldEnv)`` on ranks 0..world_size-1 in separate
    processes, each given torchrun's environment (RANK, WORLD_SIZE,
    LOCAL_RANK, MASTER_ADDR, MASTER_PORT and TORCHELASTIC_USE_AGENT_STORE)
    with the store hosted by a process of its own; the target joins the world
    itself. Results and errors as :func:`spawn_ranks`. With ``board`` (the
    ranks note their steps there) no bound is put on the whole run: a rank
    that completes no step for ``stall_s`` (``setup_s`` before its first)
    is ended as stuck, a failure like a rank's own. ``stacks``: a stuck rank
    is sent SIGUSR1 before it is ended (its threads' stacks printed, its
    flight record dumped); without it nothing is printed."""
    return _spawn(target, world_size, timeout_s, start_method, env, None,
                  failed_grace_s, joins_itself=True,
                  watch=None if board is None else StallWatch(board, stall_s, setup_s),
                  stacks=stacks)


def spawn_ranks(
    target: Callable[[RankEnv], R],
    world_size: int,
    *,
    timeout_s: float = 60.0,
    start_method: str = "fork",
    env: dict[str, str] | None = None,
    per_rank_env: Sequence[dict[str, str]] | None = None,
    failed_grace_s: float | None = None,
) -> list[R]:
    """Run ``target(RankEnv)`` on ranks 0..world_size-1 in separate processes
    joined in one gloo world; return the results in rank order.

    ``fork`` starts ranks in ~0.03 s from a parent that already imported torch
    (the parent must not have initialized torch.distributed); ``spawn`` needs a
    picklable, importable target. Raises :class:`RankFailed` if any rank
    raised or died, :class:`SyncTimeout` if the run passed ``timeout_s`` (the
    collectives' own timeout) plus a grace period. Once a rank failed, the
    others get ``failed_grace_s`` (default ``timeout_s + 5``: long enough to
    fail on their own timeout and name the lost rank) and are then ended, so
    a stuck rank never holds the launcher up for the whole budget.
    :class:`~ppsync.errors.Stopped` on SIGTERM / SIGINT (main thread only).
    Every child is gone when this returns or raises."""
    return _spawn(target, world_size, timeout_s, start_method, env, per_rank_env,
                  failed_grace_s, joins_itself=False, watch=None, stacks=True)


def _spawn(
    target: Callable[[RankEnv], R] | Callable[[WorldEnv], R],
    world_size: int,
    timeout_s: float,
    start_method: str,
    env: dict[str, str] | None,
    per_rank_env: Sequence[dict[str, str]] | None,
    failed_grace_s: float | None,
    *,
    joins_itself: bool,
    watch: StallWatch | None,
    stacks: bool,
) -> list[R]:
    ctx: Any = mp.get_context(start_method)  # "fork" or "spawn"; typeshed lacks .Process
    grace = timeout_s + 5.0 if failed_grace_s is None else failed_grace_s
    guard = StopGuard()
    with guard.active():
        procs: list[mp.process.BaseProcess] = []
        host: mp.process.BaseProcess | None = None
        conns: dict[Connection, int] = {}
        try:
            # A process of its own hosts the store: it outlives any rank that dies,
            # and the parent keeps no server thread (forking while a thread holds a
            # lock can hang the child, as a rank stuck in its TCPStore connect once
            # showed).
            host, port = _start_store_host(ctx, timeout_s)
            for rank in range(world_size):
                extra = dict(env or {})
                if per_rank_env is not None:
                    extra.update(per_rank_env[rank])
                parent_end, child_end = ctx.Pipe(duplex=False)
                job = _Job(target, rank, world_size, port, timeout_s, extra, joins_itself,
                           os.getpid(), None if watch is None else watch.board)
                p = ctx.Process(target=_child, args=(job, child_end), daemon=True)
                p.start()
                child_end.close()
                procs.append(p)
                conns[parent_end] = rank
            return _collect(procs, conns, world_size, timeout_s, grace, watch, stacks)
        finally:
            guard.hold()
            _end(procs, host, stopped=guard.signum is not None)
            for c in conns:
                c.close()
    raise AssertionError("unreachable")  # pragma: no cover


def _collect(procs: list[mp.process.BaseProcess], conns: dict[Connection, int],
             world_size: int, timeout_s: float, grace: float,
             watch: StallWatch | None = None, stacks: bool = True) -> list[R]:
    """Every rank's result, in rank order; RankFailed / SyncTimeout as
    :func:`spawn_ranks` says. ``conns`` keeps the ranks not yet heard from."""
    results: dict[int, R] = {}
    errors: dict[int, BaseException | str] = {}
    deadline = time.monotonic() + (timeout_s + 10.0 if watch is None else float("inf"))
    while conns:
        if watch is not None:
            stuck = watch.stuck(sorted(conns.values()))
            if stuck and stacks:
                _dump_stacks([procs[r] for r in stuck])
                deadline = min(deadline, time.monotonic() + grace)
            for r, why in stuck.items():
                del conns[next(c for c, rank in conns.items() if rank == r)]
                errors[r] = why
            if not conns:
                break
        left = min(deadline - time.monotonic(), 1.0 if watch is not None else float("inf"))
        if deadline - time.monotonic() <= 0:
            if stacks:
                _dump_stacks([procs[r] for r in conns.values()])
            if errors:  # the others had their grace after the first failure
                first = min(errors)
                for r in conns.values():
                    errors[r] = (f"rank {r} still running {grace:.0f} s after rank {first} "
                                 "failed: ended")
                break
            raise SyncTimeout(
                f"ranks {sorted(conns.values())} did not finish within "
                f"timeout_s + 10 = {timeout_s + 10:.0f} s"
            )
        for c in wait(list(conns), timeout=max(0.0, left)):
            rank = conns.pop(c)  # type: ignore[call-overload]
            assert isinstance(c, Connection)
            try:
                kind, payload = c.recv()
            except EOFError:
                procs[rank].join(timeout=1.0)
                errors[rank] = f"rank {rank} died (exit code {procs[rank].exitcode})"
            else:
                if kind == "ok":
                    results[rank] = payload
                else:
                    errors[rank] = payload
            if rank in errors:
                deadline = min(deadline, time.monotonic() + grace)
    if errors:
        first = min(errors, key=lambda r: (_lead(errors[r]), r))
        raise RankFailed(
            f"{len(errors)} of {world_size} ranks failed; rank {first}: {errors[first]!r}",
            errors,
        )
    return [results[r] for r in range(world_size)]


def _lead(error: BaseException | str) -> int:
    """Which rank's error RankFailed leads with, lowest first: a rank that
    died; one whose error is its own; a PeerLost / SyncTimeout (it follows
    from another rank's failure, and names it); a rank ended after the grace."""
    if isinstance(error, str):
        return 0 if "died" in error else 3
    return 2 if isinstance(error, PeerLost | SyncTimeout) else 1


def _end(procs: list[mp.process.BaseProcess], host: mp.process.BaseProcess | None,
         *, stopped: bool) -> None:
    """End every rank, then the store. After a stop signal each gets SIGTERM
    (a rank dumps its flight record) and :data:`STOP_GRACE_S` before SIGKILL;
    otherwise a rank that reported gets 2 s to exit."""
    if stopped:
        for p in procs:
            if p.pid is not None and p.is_alive():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGTERM)
    end = time.monotonic() + (STOP_GRACE_S if stopped else 2.0)
    for p in procs:
        p.join(timeout=max(0.0, end - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(timeout=5.0)
    if host is not None:
        host.kill()
        host.join(timeout=5.0)
