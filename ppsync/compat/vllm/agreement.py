"""Every PP rank of a vLLM engine runs ppsync's handler with the same settings,
or none serves: the check each plugin-built handler makes before its token
group exists.

On one host every worker reads one environment. Across hosts each node reads
its own (vLLM's multi-node launch: ``vllm serve --nnodes N``, ``--headless``
on the other nodes), so a node can run without ``PPSYNC_VLLM=1`` (vLLM's own
``PPHandler``) or with other ``PPSYNC_*`` values. ppsync's handler then
makes its token group (a ``new_group``) and its configuration handshake (an
all-gather): a rank on vLLM's handler never enters either, and the ranks
that did wait on the group's creation until gloo's own timeout with a
message that names no rank; a different timeout or on-error choice is not
in the handshake at all.

So before any of that each rank writes what it runs under one key of the
PP group's store (:func:`agree`: its PP and global rank, host, pid,
ppsync's version, the vLLM interface, every setting but the dump
directory) and reads every other rank's, polling, for at most
``timeout_s`` (its own start-up bound: a rank still loading its model
catches up well within it). A rank that never wrote (vLLM's handler
there, or no ppsync on its node) or one whose settings differ ends this
rank's start with one :class:`ConfigError` line naming that rank, its
host and the difference; nothing has been collective yet, so no rank is
left in a collective by it. What every rank wrote also names a lost or
silent stage's host later (:meth:`Peers.where`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from ppsync.compat.vllm.settings import (
    ENV_CARRIER,
    ENV_CODEC,
    ENV_CPU_KERNELS,
    ENV_DEVICE_KERNELS,
    ENV_EMULATE,
    ENV_ON_ERROR,
    ENV_SILENT,
    ENV_TIMEOUT,
    PluginSettings,
)
from ppsync.errors import ConfigError

__all__ = ["KEY", "Peers", "RankFacts", "StoreLike", "agree", "differences", "facts_here"]

KEY = "ppsync/vllm/rank/{rank}"
"""Each global rank's facts in the PP group's store."""
POLL_S = 0.2
SETTING_NAMES = {"codec": ENV_CODEC, "carrier": ENV_CARRIER, "cpu_kernels": ENV_CPU_KERNELS,
                 "device_kernels": ENV_DEVICE_KERNELS, "timeout_s": ENV_TIMEOUT,
                 "silent_s": ENV_SILENT, "emulate": ENV_EMULATE, "on_error": ENV_ON_ERROR}
"""How a message names a setting: by the variable an operator sets."""
NOT_COMPARED = ("dump_dir",)  # a per-node path: may differ between hosts
SAME_EVERYWHERE = "set PPSYNC_VLLM=1 and the same PPSYNC_* variables on every node"


class StoreLike(Protocol):
    """The calls of a torch.distributed store this module makes."""

    def set(self, key: str, value: str) -> None: ...

    def get(self, key: str) -> bytes: ...

    def check(self, keys: list[str]) -> bool: ...


@dataclass(frozen=True)
class RankFacts:
    """What one rank runs, as it announced it."""

    global_rank: int
    pp_rank: int
    host: str  # the hostname, and VLLM_HOST_IP where set
    pid: int
    version: str  # ppsync's
    interface: str  # the vLLM handler interface
    settings: tuple[tuple[str, str], ...]  # every compared setting, as text

    def who(self) -> str:
        return (f"PP rank {self.pp_rank} (global rank {self.global_rank}, host {self.host}, "
                f"pid {self.pid})")


def _host() -> str:
    name = socket.gethostname()
    ip = os.environ.get("VLLM_HOST_IP", "").strip()
    return f"{name} {ip}" if ip else name


def facts_here(settings: PluginSettings, *, global_rank: int, pp_rank: int,
               interface: str, version: str) -> RankFacts:
    """This process's facts (every setting but :data:`NOT_COMPARED`, so a
    setting added to PluginSettings is compared without a change here)."""
    compared = tuple((name, "unset" if value is None else f"{value:g}"
                      if isinstance(value, float) else str(value))
                     for name, value in dataclasses.asdict(settings).items()
                     if name not in NOT_COMPARED)
    return RankFacts(global_rank=global_rank, pp_rank=pp_rank, host=_host(), pid=os.getpid(),
                     version=version, interface=interface, settings=compared)


def differences(mine: RankFacts, theirs: RankFacts) -> list[str]:
    """How ``theirs`` differs from ``mine`` ("X here, Y there" per item)."""
    out = []
    if theirs.version != mine.version:
        out.append(f"ppsync {mine.version} here, {theirs.version} there")
    if theirs.interface != mine.interface:
        out.append(f"vLLM interface {mine.interface} here, {theirs.interface} there")
    their_settings = dict(theirs.settings)
    for name, value in mine.settings:
        other = their_settings.get(name, "absent")
        if other != value:
            out.append(f"{SETTING_NAMES.get(name, name)} {value} here, {other} there")
    return out


@dataclass(frozen=True)
class Peers:
    """Every rank's facts, agreed (by global rank)."""

    facts: Mapping[int, RankFacts]

    def who(self, global_rank: int | None) -> str | None:
        """"PP rank r (global rank g, host h, pid p)"; None for a rank unknown."""
        f = None if global_rank is None else self.facts.get(global_rank)
        return None if f is None else f.who()


def agree(store: StoreLike, mine: RankFacts, ranks: Sequence[int], *,
          timeout_s: float) -> Peers:
    """Announce ``mine`` and read every rank of ``ranks`` (global ranks, the
    PP group's), for at most ``timeout_s``; ConfigError, one line, at the
    first rank that never announced or differs (see the module docstring)."""
    store.set(KEY.format(rank=mine.global_rank), json.dumps(dataclasses.asdict(mine)))
    deadline = time.monotonic() + timeout_s
    seen: dict[int, RankFacts] = {mine.global_rank: mine}
    while True:
        for rank in ranks:
            if rank in seen or not store.check([KEY.format(rank=rank)]):
                continue
            raw = json.loads(store.get(KEY.format(rank=rank)))
            raw["settings"] = tuple(tuple(s) for s in raw["settings"])
            theirs = RankFacts(**raw)
            seen[rank] = theirs
            diffs = differences(mine, theirs)
            if diffs:
                raise ConfigError(
                    f"ppsync: {mine.who()} refuses to serve: {theirs.who()} runs other "
                    f"settings ({'; '.join(diffs)}); {SAME_EVERYWHERE}")
        missing = [r for r in ranks if r not in seen]
        if not missing:
            return Peers(seen)
        if time.monotonic() >= deadline:
            pp = {r: i for i, r in enumerate(ranks)}
            names = ", ".join(f"PP rank {pp[r]} (global rank {r})" for r in missing)
            raise ConfigError(
                f"ppsync: {mine.who()} refuses to serve: {names} did not announce ppsync's "
                f"settings within {ENV_TIMEOUT} = {timeout_s:g} s: it runs vLLM's own "
                "PPHandler (PPSYNC_VLLM=1 not set on its node, or ppsync not installed "
                f"there) or never started; {SAME_EVERYWHERE}")
        time.sleep(POLL_S)
