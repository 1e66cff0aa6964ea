"""The rank code of ``ppsync run``: one process, one world rank.

Every rank runs the same steps: check the PP groups (before anything connects),
join the world, make every PP group and its token group (a tensor x pipeline
PP groups when WORLD_SIZE > pp_size), run the workload on its own PP group with
a failure board in the run's store, then gather every rank's report over the
world so that every rank holds the whole :class:`RunReport` and exits with
the same verdict. ``ppsync launch`` spawns processes that run exactly this.
"""

from __future__ import annotations

import datetime
import os
import secrets
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TextIO

import torch
import torch.distributed as dist

from ppsync.core.codec import frames_home, frames_on_device
from ppsync.core.codec.carriers import STATS as COPY_STATS
from ppsync.core.path.token_path import TokenPath
from ppsync.core.recorder.registry import set_world
from ppsync.core.wire.board import FailureBoard
from ppsync.core.wire.completion import STATS, completion_for, emulate
from ppsync.core.wire.groups import group_facts, pipeline_groups, token_groups
from ppsync.core.wire.platform import platform_for
from ppsync.errors import ConfigError
from ppsync.harness.driver import (
    Framework,
    run_async_rank_blocking,
    run_sync_rank,
    workload_config,
)
from ppsync.harness.lifetime import set_process_name
from ppsync.harness.world import WorldEnv
from ppsync.schemas.config import SyncConfig
from ppsync.schemas.run_report import RankReport, RunReport


@dataclass(frozen=True, slots=True)
class RunOptions:
    """How a run drives its ranks (beyond the token path's config)."""

    steps: int
    seed: int = 0
    framework: Framework | None = None  # None: the synchronous core
    jitter_us: float = 0.0  # per rank per step, a random pause in [0, jitter_us]
    knobs: dict[str, object] = field(default_factory=dict)  # WorkloadConfig overrides
    progress_s: float | None = None  # world rank 0 prints progress this often; None: never
    join_timeout_s: float = 120.0  # bound on joining the world (ranks start at different times)
    device: str = "cpu"  # cpu, cuda, xpu: where the device codec's tensors live
    run_id: str | None = None  # the run's name in the store (ppsync run --run-id)
    emulate: str | None = None  # "nccl": the token groups behave as NCCL's (the CPU twin)


class Progress:
    """One line to ``out`` every ``every_s`` seconds: steps done of the
    ``steps`` asked for (and the ``drain`` steps that end the run, D, when
    there are any), steps/s and ETA. The clock starts at the first step, not
    when this is built: the group, the handshake and the kernels' loading
    are not steps."""

    def __init__(self, steps: int, every_s: float, out: TextIO | None = None, *,
                 drain: int = 0) -> None:
        self.steps = steps
        self.drain = drain
        self.every_s = every_s
        self.out = out
        self.started: float | None = None
        self.first_done = 0
        self.next_at = 0.0

    def __call__(self, step: int) -> None:
        now = time.monotonic()
        done = step + 1
        if self.started is None:  # the first step: the clock starts here
            self.started, self.first_done = now, done
            self.next_at = now + self.every_s
            return
        if now < self.next_at:
            return
        self.next_at = now + self.every_s
        rate = (done - self.first_done) / max(now - self.started, 1e-9)
        total = self.steps + self.drain
        eta = (total - done) / rate if rate > 0 else 0.0
        of = f"{total} ({self.steps} + {self.drain} drain)" if self.drain else f"{total}"
        print(f"ppsync: step {done}/{of}  {rate:.0f} steps/s  ETA {eta:.0f} s",
              file=self.out or sys.stderr, flush=True)


def _run_group(
    config: SyncConfig,
    opts: RunOptions,
    group: dist.ProcessGroup,
    board: FailureBoard,
    progress: Callable[[int], None] | None,
    device: torch.device | None,
) -> RankReport:
    wcfg = workload_config(config, steps=opts.steps, seed=opts.seed, **opts.knobs)
    if opts.framework is None:
        path = TokenPath(config, group, board=board, device=device)
        return run_sync_rank(path, wcfg, jitter_us=opts.jitter_us, progress=progress)
    return run_async_rank_blocking(config, group, wcfg, opts.framework, board, opts.jitter_us,
                                   progress=progress, device=device)


TWIN_ABORT_HANG = "PPSYNC_TWIN_ABORT_HANG_S"
"""Seconds the CPU twin's NCCL abort blocks (``inf``: for ever), as
``ncclCommAbort`` can when another communicator's kernel is stuck: for the
fault suites' runs of ``launch --emulate nccl``."""


def twin_abort_hang_s() -> float:
    """:data:`TWIN_ABORT_HANG` as a number (0 when unset); ConfigError otherwise."""
    text = os.environ.get(TWIN_ABORT_HANG, "0")
    try:
        return float(text)
    except ValueError:
        raise ConfigError(f"{TWIN_ABORT_HANG} = {text!r} must be a number of seconds "
                          "(inf: for ever)") from None


def completion_facts(group: dist.ProcessGroup, emulated: str | None) -> dict[str, object]:
    """The report's fields on the token group's completion semantics; on
    the CPU twin, what its stand-in streams saw in this process; with the
    host carrier (where frames went through pinned memory), its copies' counts."""
    facts: dict[str, object] = {"completion": completion_for(group, group_facts(group)[3]).name}
    if emulated is not None:
        facts |= {"engine_waits_unconsumed": STATS.engine_waits_unconsumed,
                  "engine_waits_consumed": STATS.engine_waits_consumed}
    if COPY_STATS.built:
        facts |= {"copy_waits": COPY_STATS.copy_waits,
                  "pinned_reused_early": COPY_STATS.reused_early}
    return facts


def rank_device(kind: str, codec: str, local_rank: int) -> torch.device | None:
    """This rank's device for ``--device kind``: None on CPU, else the
    accelerator at LOCAL_RANK modulo the visible count. ConfigError for an
    accelerator without the device codec or without a device to use."""
    if kind == "cpu":
        return None
    if not frames_on_device(codec):
        raise ConfigError(f"--device {kind} needs --codec device (host frames live on the CPU)")
    mod = getattr(torch, kind, None)
    count = mod.device_count() if mod is not None and mod.is_available() else 0
    if count == 0:
        raise ConfigError(f"--device {kind}: no {kind} device is available here")
    return torch.device(kind, local_rank % count)


def run_rank(config: SyncConfig, opts: RunOptions, world: WorldEnv) -> RunReport:
    """Run this rank's part of the check and return the whole run's report
    (the same on every rank). Raises :class:`ConfigError` before connecting
    when WORLD_SIZE is not a multiple of pp_size; any fault raises."""
    pp_groups = pipeline_groups(world.world_size, config.pp_size)
    device = rank_device(opts.device, config.codec, world.local_rank)  # before connecting
    store = world.connect(opts.join_timeout_s, opts.run_id)
    # one id for every dump of this world: the first rank's pick, kept in the run's store
    set_world(int(store.compare_set("dump_world_id", "", str(secrets.randbits(62) | 1))),
              world.world_size)
    if device is not None:
        getattr(torch, device.type).set_device(device)
    backend = None if device is None else frames_home(config.codec, config.carrier,
                                                      platform_for(device))[0]
    # Making a gloo group connects its ranks, which may still be starting (a
    # loaded host, containers): bounded by the join timeout, like joining (with
    # --timeout, 10 s, a compose run failed in connectFullMesh). Their
    # collectives then get the run's own timeout (the token path sets its
    # group's; the final gather's is set here).
    _, group = token_groups(pp_groups, timeout_s=opts.join_timeout_s, backend=backend)
    if opts.emulate is not None:
        emulate(group, opts.emulate, carrier=config.carrier, abort_hang_s=twin_abort_hang_s())
    gather = dist.new_group(list(range(world.world_size)),
                            timeout=datetime.timedelta(seconds=opts.join_timeout_s))
    gather.set_timeout(datetime.timedelta(seconds=config.timeout_s))
    index = next(i for i, ranks in enumerate(pp_groups) if world.rank in ranks)
    role = "last" if pp_groups[index][-1] == world.rank else "recv"
    set_process_name(f"ppsync r{world.rank} {role}")  # what `ps -e` and `top` show
    board = FailureBoard(store, ranks=pp_groups[index], me=world.rank)
    progress = None
    if opts.progress_s is not None and world.rank == 0:
        progress = Progress(opts.steps, opts.progress_s, drain=config.depth)
    try:
        mine = _run_group(config, opts, group, board, progress, device)
    except Exception:
        if world.hosts_store:
            # survivors are still reading the failure board to name the lost
            # rank: keep the store up for their grace before this process exits
            time.sleep(board.grace_s + 2 * board.slice_s)
        raise
    mine = mine.model_copy(update={"global_rank": world.rank, "pp_group": index,
                                   **completion_facts(group, opts.emulate)})
    reports: list[RankReport | None] = [None] * world.world_size
    dist.all_gather_object(reports, mine, group=gather)
    ranks = [r for r in reports if r is not None]
    return RunReport(
        config=config, steps=opts.steps, seed=opts.seed,
        mode="sync" if opts.framework is None else "async",
        world_size=world.world_size, ranks=ranks, framework=opts.framework, emulate=opts.emulate,
    )
