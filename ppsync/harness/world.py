"""One rank's world from torchrun's environment convention.

``ppsync run`` is configured only by the environment that torchrun, a
docker-compose service or a scheduler sets: RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR, MASTER_PORT. Every variable is checked before anything connects,
and a bad one is a :class:`ConfigError` that names it.

The store at MASTER_ADDR:MASTER_PORT carries the rendezvous and the failure
board. Who hosts it decides what survivors can say when a rank dies:

- torchrun (c10d rendezvous) sets ``TORCHELASTIC_USE_AGENT_STORE=True``: the
  agent on the first node hosts the store, every worker is a client, and the
  store outlives any worker, so survivors name the lost rank. ``ppsync
  launch`` does the same with a store process of its own.
- plain env:// (no agent): rank 0's process hosts the store. If any other rank
  dies, survivors name it as above (rank 0, failing too, keeps the store up
  for the board's grace before it exits). If rank 0 dies, the store dies with it:
  the board can no longer be read, and survivors still fail typed and within
  the timeout (:class:`~ppsync.errors.PeerLost` or
  :class:`~ppsync.errors.SyncTimeout`), but without naming the lost rank.

A rank whose link is cut cannot reach the store either: its board calls are
bounded (:class:`BoundedStore`), so it too fails within about the timeout,
and the others name it as silent. Joining is bounded separately (ranks start
seconds apart): a rank whose peers never come gets a SyncTimeout.
"""

from __future__ import annotations

import contextlib
import datetime
import socket
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import torch.distributed as dist
from torch._C._distributed_c10d import PrefixStore, Store, TCPStore

from ppsync.errors import ConfigError, SyncTimeout

T = TypeVar("T")

VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def _int(env: Mapping[str, str], name: str, low: int, high: int | None, rule: str) -> int:
    text = env.get(name)
    if text is None or not text.strip():
        raise ConfigError(
            f"environment variable {name} is not set; ppsync run takes its place in the "
            f"world from torchrun's environment ({', '.join(VARIABLES)})"
        )
    try:
        value = int(text.strip())
    except ValueError:
        raise ConfigError(f"{name} = {text!r} must be an integer ({rule})") from None
    if value < low or (high is not None and value > high):
        raise ConfigError(f"{name} = {value} must be {rule}")
    return value


@dataclass(frozen=True, slots=True)
class WorldEnv:
    """This process's place in the world, as the environment gives it."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    agent_store: bool  # the store is hosted outside the ranks (torchrun's agent, launch)
    attempt: str  # keys of one torchrun restart do not mix with another's
    run_id: str | None = None  # torchrun's TORCHELASTIC_RUN_ID, when set

    @classmethod
    def from_environ(cls, env: Mapping[str, str]) -> WorldEnv:
        """Read and check the variables; raises :class:`ConfigError` naming
        the first one that is missing or malformed."""
        world_size = _int(env, "WORLD_SIZE", 1, None, ">= 1")
        rank = _int(env, "RANK", 0, world_size - 1,
                    f"in [0, WORLD_SIZE - 1 = {world_size - 1}]")
        local_rank = _int(env, "LOCAL_RANK", 0, None, ">= 0")
        addr = env.get("MASTER_ADDR", "").strip()
        if not addr:
            raise ConfigError(
                "environment variable MASTER_ADDR is not set; it names the host of "
                "the rank-0 store (a host name or an address)"
            )
        port = _int(env, "MASTER_PORT", 1, 65535, "in [1, 65535]")
        return cls(
            rank=rank, world_size=world_size, local_rank=local_rank, master_addr=addr,
            master_port=port,
            agent_store=env.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
            attempt=env.get("TORCHELASTIC_RESTART_COUNT", "0"),
            run_id=env.get("TORCHELASTIC_RUN_ID"),
        )

    @property
    def hosts_store(self) -> bool:
        """Whether this process serves the store (plain env://, rank 0)."""
        return not self.agent_store and self.rank == 0

    def connect(self, join_timeout_s: float, run_id: str | None = None) -> Store:
        """Join the store and the gloo world; return this run's part of the
        store for failure boards (a connection of its own). Ranks start at
        different times (containers, image pulls, ``import torch``), so
        joining, and making groups later, is bounded by ``join_timeout_s``
        (one deadline for every step of it), not by the collectives'
        timeout. Every wait runs in slices of at most :data:`JOIN_SLICE_S`,
        so a signal's handler runs within a slice (SIGTERM ends a joining
        rank at once). Raises :class:`SyncTimeout` when not every rank
        arrived in time, naming the ranks that never did."""
        deadline = time.monotonic() + join_timeout_s
        with _joining():
            store = self._store_client(deadline, join_timeout_s)
            scope = run_scope(store, self, run_id)
            self._arrive(store, scope, run_id, deadline, join_timeout_s)
            left = max(1.0, deadline - time.monotonic())
            try:
                # in a thread of its own: the main thread waits in slices, so a
                # signal's handler runs (SIGTERM ends the rank) while torch's
                # rendezvous blocks in C++ (a stale arrival key lets a rank get here
                # while a peer is still far from it)
                interruptible(lambda: dist.init_process_group(
                    "gloo", store=PrefixStore(f"{scope}/world", store), rank=self.rank,
                    world_size=self.world_size, timeout=datetime.timedelta(seconds=left),
                ))
            except RuntimeError as e:  # torch's DistError family: the store, the rendezvous
                seen = _other_runs(store, self, run_id)
                why = seen or f"the rendezvous did not complete ({_first_line(e)})"
                raise self._join_timeout(join_timeout_s, why) from None
            # The board's own connection, so a board call stuck on a cut link never
            # holds the rendezvous' one. When the link is cut, TCPStore's client does
            # not give up, so FailureBoard bounds each call itself
            # (ppsync.core.wire.board); connecting may take as long as joining did.
            board = TCPStore(self.master_addr, self.master_port, is_master=False,
                             timeout=datetime.timedelta(seconds=join_timeout_s))
        return PrefixStore(scope, board)

    def _join_timeout(self, join_timeout_s: float, why: str) -> SyncTimeout:
        return SyncTimeout(
            f"rank {self.rank} of {self.world_size} could not join the world at "
            f"{self.master_addr}:{self.master_port} within join timeout = "
            f"{join_timeout_s} s: {why}")

    def _cannot_join(self, why: str) -> ConfigError:
        return ConfigError(f"rank {self.rank} of {self.world_size} could not join: {why}")

    def _store_client(self, deadline: float, join_timeout_s: float) -> TCPStore:
        """The store: hosted here (plain env://, rank 0), or reached once its
        host listens. Every wait is a Python socket call of at most
        :data:`JOIN_SLICE_S` (a signal's handler runs between them), and no
        TCPStore client is made before the host accepts a connection: each
        failed attempt of torch's client logs a C++ stack trace."""
        full = datetime.timedelta(seconds=join_timeout_s)
        where = f"MASTER_ADDR:MASTER_PORT = {self.master_addr}:{self.master_port}"
        if self.hosts_store:
            try:
                _resolve(self.master_addr, self.master_port)
            except OSError as e:
                raise self._cannot_join(f"MASTER_ADDR = {self.master_addr!r} does not resolve "
                                        f"({e.strerror or e}); it names this host, which "
                                        "serves the store") from None
            try:  # the server listens on every address; its own client uses loopback
                store = TCPStore("127.0.0.1", self.master_port, self.world_size,
                                 is_master=True, timeout=full, wait_for_workers=False)
            except RuntimeError as e:  # EADDRINUSE, EACCES
                raise self._cannot_join(f"cannot serve the store on port {self.master_port} "
                                        f"(MASTER_PORT): {_first_line(e)}") from None
            # every other rank connects at MASTER_ADDR: it must reach this store
            error = _wait_until_listening(self.master_addr, self.master_port, deadline)
            if error is not None:
                raise self._cannot_join(f"{where} does not reach the store this rank serves "
                                        f"within join timeout = {join_timeout_s} s ({error}); "
                                        "the other ranks could not reach it either")
            return store
        while True:
            error = _wait_until_listening(self.master_addr, self.master_port, deadline)
            if error is not None:
                raise self._join_timeout(join_timeout_s, f"no store answered ({error})")
            left = deadline - time.monotonic()
            try:
                store = TCPStore(
                    self.master_addr, self.master_port, self.world_size, is_master=False,
                    timeout=datetime.timedelta(seconds=max(JOIN_SLICE_S, min(5.0, left))),
                    wait_for_workers=False)
            except RuntimeError as e:  # its host went away again
                if left <= JOIN_SLICE_S:
                    raise self._join_timeout(
                        join_timeout_s, f"no store answered ({_first_line(e)})") from None
                continue
            store.set_timeout(full)
            return store

    def _arrive(self, store: Store, scope: str, run_id: str | None, deadline: float,
                join_timeout_s: float) -> None:
        """Post this rank's arrival under ``scope`` and wait, in slices, until
        every rank posted its own: after that, the rendezvous has every rank."""
        keys = [f"{scope}/arrived/{r}" for r in range(self.world_size)]
        try:
            store.set(keys[self.rank], "1")
            while not store.check(keys):
                if time.monotonic() >= deadline:
                    missing = [r for r, k in enumerate(keys) if not store.check([k])]
                    raise self._join_timeout(join_timeout_s,
                                             _never_arrived(store, self, run_id, missing))
                time.sleep(JOIN_POLL_S)
            # An arrival key of an earlier process of a rank (one that counted this
            # run, arrived and died) also passes the check: a rank now counted in
            # another run will never join this one
            seen = _other_runs(store, self, run_id)
            if seen:
                raise self._join_timeout(join_timeout_s, seen)
        except RuntimeError as e:  # the store's host went away (DistNetworkError)
            host = "its host" if self.agent_store else "its host, rank 0,"
            raise self._join_timeout(
                join_timeout_s, f"the store went away while waiting for the other ranks "
                f"({host} gave up or died): {type(e).__name__}: {str(e).splitlines()[0]}"
            ) from e


JOIN_SLICE_S = 0.5
"""The longest one blocking call of a join may last: a signal that arrives
meanwhile is handled when it returns."""
JOIN_POLL_S = 0.05
"""How often a joining rank looks for the others' arrivals."""
_joining_now = False


@contextlib.contextmanager
def _joining() -> Iterator[None]:
    global _joining_now
    _joining_now = True
    try:
        yield
    finally:
        _joining_now = False


def joining() -> bool:
    """Whether this process is joining the world right now (for the line a
    signal handler prints)."""
    return _joining_now


def _base_id(env_run_id: str | None, run_id: str | None) -> str:
    """The run's name given from outside: ``--run-id``, else torchrun's
    TORCHELASTIC_RUN_ID (its default "none" names nothing), else ''."""
    for given in (run_id, env_run_id):
        if given and given.strip() and given.strip() != "none":
            return given.strip()
    return ""


def run_scope(store: Store, world: WorldEnv, run_id: str | None) -> str:
    """The store prefix of this run: every key of the rendezvous and the
    board lives under it, so a store that outlives a run (torchrun's agent
    store, a store kept for the board) never hands a later run an earlier
    run's keys. It carries the run's name when one is given, the torchrun
    restart, and this rank's count of runs on this store under that name
    (every rank of a run counts the same, as long as each earlier run's
    ranks all got this far)."""
    base = _run_base(world, run_id)
    count = store.add(f"{base}/runs_of_rank/{world.rank}", 1)
    return f"{base}/run_{count}"


def _run_base(world: WorldEnv, run_id: str | None) -> str:
    return f"ppsync/{_base_id(world.run_id, run_id) or 'runs'}/attempt_{world.attempt}"


def _never_arrived(store: Store, world: WorldEnv, run_id: str | None,
                   missing: list[int]) -> str:
    """Names the ranks that never arrived, and what this store counts for
    each when it differs from this rank's run."""
    names = ", ".join(f"rank {r}" for r in missing)
    return f"never arrived: {names}" + "".join(
        f" ({seen})" for seen in [_other_runs(store, world, run_id, missing)] if seen)


def _other_runs(store: Store, world: WorldEnv, run_id: str | None,
                ranks: list[int] | None = None) -> str:
    """'' when this store counts every rank of ``ranks`` (default all) in
    this rank's run; else what it counts for each that differs, and the
    remedy: an earlier run on the store lost ranks before they joined (or a
    rank has not started yet), so the counts no longer meet."""
    base = _run_base(world, run_id)
    mine = store.add(f"{base}/runs_of_rank/{world.rank}", 0)
    seen = []
    for r in range(world.world_size) if ranks is None else ranks:
        n = store.add(f"{base}/runs_of_rank/{r}", 0)
        if n != mine:
            where = "arrived there" if store.check([f"{base}/run_{n}/arrived/{r}"]) else ""
            seen.append(f"rank {r} in run {n}" + (f", {where}" if where else ""))
    if not seen:
        return ""
    return (f"this store counts this rank in run {mine} and " + "; ".join(seen)
            + ": an earlier run on this store lost ranks (or a rank has not started); "
            "give every rank the same --run-id")


def _first_line(e: BaseException) -> str:
    """An error of torch's, in one line and without the store keys it waited
    for: ``DistStoreError: wait timeout after 5000ms``."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {text.split(', keys:')[0]}"


def _resolve(addr: str, port: int) -> list[tuple[int, tuple[object, ...]]]:
    """The TCP addresses ``addr`` resolves to (socket.gaierror if none)."""
    infos = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)
    return [(family, sockaddr) for family, _, _, _, sockaddr in infos]


def _wait_until_listening(addr: str, port: int, deadline: float) -> str | None:
    """Connect to ``addr:port`` and close, in attempts of at most
    :data:`JOIN_SLICE_S`, until one succeeds (None) or the deadline passes
    (the last error, in words)."""
    error = "no attempt"
    while True:
        left = deadline - time.monotonic()
        try:
            for family, sockaddr in _resolve(addr, port):
                with socket.socket(family, socket.SOCK_STREAM) as s:
                    s.settimeout(max(0.05, min(JOIN_SLICE_S, left)))
                    try:
                        s.connect(sockaddr)
                    except OSError as e:
                        error = f"{addr}:{port}: {e.strerror or type(e).__name__}"
                        continue
                    return None
        except socket.gaierror as e:
            error = f"MASTER_ADDR = {addr!r} does not resolve ({e.strerror})"
        if time.monotonic() >= deadline:
            return error
        time.sleep(min(JOIN_POLL_S * 4, max(0.0, deadline - time.monotonic())))


def interruptible(call: Callable[[], T]) -> T:
    """Run ``call`` (a blocking call into torch's C++) in a thread of its own
    and wait for it in slices of :data:`JOIN_SLICE_S`, so that this thread's
    signal handlers still run (SIGTERM ends a joining rank at once)."""
    box: dict[str, Any] = {}

    def body() -> None:
        try:
            box["value"] = call()
        except BaseException as e:  # handed to the waiting thread, raised there
            box["error"] = e

    t = threading.Thread(target=body, name="ppsync-join", daemon=True)
    t.start()
    while t.is_alive():
        t.join(JOIN_SLICE_S)
    if "error" in box:
        raise box["error"]
    value: T = box["value"]
    return value
