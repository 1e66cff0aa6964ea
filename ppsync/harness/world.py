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
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import TypeVar

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
                dist.init_process_group(
                    "gloo", store=PrefixStore(f"{scope}/world", store), rank=self.rank,
                    world_size=self.world_size, timeout=datetime.timedelta(seconds=left),
                )
            except RuntimeError as e:  # torch's DistError family: the store, the rendezvous
                raise self._join_timeout(join_timeout_s, f"{type(e).__name__}: {e}") from e
            # The board's own connection, so a board call stuck on a cut link never
            # holds the rendezvous' one. When the link is cut, TCPStore's client does
            # not give up, so FailureBoard bounds each call itself
            # (ppsync.core.liveness); connecting may take as long as joining did.
            board = TCPStore(self.master_addr, self.master_port, is_master=False,
                             timeout=datetime.timedelta(seconds=join_timeout_s))
        return PrefixStore(scope, board)

    def _join_timeout(self, join_timeout_s: float, why: str) -> SyncTimeout:
        return SyncTimeout(
            f"rank {self.rank} of {self.world_size} could not join the world at "
            f"{self.master_addr}:{self.master_port} within join timeout = "
            f"{join_timeout_s} s: {why}")

    def _store_client(self, deadline: float, join_timeout_s: float) -> TCPStore:
        """The store: hosted here (plain env://, rank 0), or reached in slices
        until the deadline (its host may not be listening yet)."""
        full = datetime.timedelta(seconds=join_timeout_s)
        if self.hosts_store:
            return TCPStore(self.master_addr, self.master_port, self.world_size,
                            is_master=True, timeout=full, wait_for_workers=False)
        while True:
            left = deadline - time.monotonic()
            try:
                store = TCPStore(
                    self.master_addr, self.master_port, self.world_size, is_master=False,
                    timeout=datetime.timedelta(seconds=max(0.05, min(JOIN_SLICE_S, left))),
                    wait_for_workers=False)
            except RuntimeError as e:  # not listening yet (DistStoreError / DistNetworkError)
                if left <= JOIN_SLICE_S:
                    raise self._join_timeout(
                        join_timeout_s, f"no store answered ({type(e).__name__}: {e})") from e
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
    """Names the ranks that never arrived, and the run each counts on this
    store when it differs from this rank's (an earlier run lost a rank
    before it joined: give every rank one --run-id)."""
    names = ", ".join(f"rank {r}" for r in missing)
    base = _run_base(world, run_id)
    mine = store.add(f"{base}/runs_of_rank/{world.rank}", 0)
    other = {r: store.add(f"{base}/runs_of_rank/{r}", 0) for r in missing}
    ahead = [r for r, n in other.items() if n not in (mine, mine - 1)]
    text = f"never arrived: {names}"
    if ahead:
        text += (f" (this store counts run {mine} for this rank but "
                 + ", ".join(f"run {other[r]} for rank {r}" for r in ahead)
                 + ": an earlier run lost ranks; give every rank the same --run-id)")
    return text
