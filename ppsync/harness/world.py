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

import datetime
from collections.abc import Mapping
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
        )

    @property
    def hosts_store(self) -> bool:
        """Whether this process serves the store (plain env://, rank 0)."""
        return not self.agent_store and self.rank == 0

    def connect(self, join_timeout_s: float) -> Store:
        """Join the store and the gloo world; return this run's part of the
        store for failure boards (a connection of its own). Ranks start at
        different times (containers, image pulls, ``import torch``), so
        joining, and making groups later, is bounded by
        ``join_timeout_s``, not by the collectives' timeout. Raises
        :class:`SyncTimeout` when not every rank arrived in time."""
        timeout = datetime.timedelta(seconds=join_timeout_s)
        try:
            store = TCPStore(
                self.master_addr, self.master_port, self.world_size,
                is_master=self.hosts_store,
                timeout=timeout, wait_for_workers=False,
            )
            prefix = f"ppsync/attempt_{self.attempt}"
            dist.init_process_group(
                "gloo", store=PrefixStore(f"{prefix}/world", store), rank=self.rank,
                world_size=self.world_size, timeout=timeout,
            )
        except RuntimeError as e:  # torch's DistError family: the store, the rendezvous
            raise SyncTimeout(
                f"rank {self.rank} of {self.world_size} could not join the world at "
                f"{self.master_addr}:{self.master_port} within join timeout = "
                f"{join_timeout_s} s: {type(e).__name__}: {e}"
            ) from e
        # The board's own connection, so a board call stuck on a cut link never
        # holds the rendezvous' one. When the link is cut, TCPStore's client does
        # not give up (measured: still blocked 15 s after a cut with a 1 s store
        # timeout), so FailureBoard bounds each call itself (ppsync.core.liveness);
        # connecting may take as long as joining did (a loaded host's DNS: a 1 s
        # bound here once failed a compose run).
        board = TCPStore(self.master_addr, self.master_port, is_master=False,
                         timeout=timeout)
        return PrefixStore(prefix, board)
