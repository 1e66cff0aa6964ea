"""The token path's own CPU per step, hot, on the real path in one process:

    python -m ppsync.bench.codec_cpu [--rows 256] [--spec 2] [--iters 3000]

One process holds both ranks of a real two-rank gloo group (two gloo
backends over one in-process store, made side by side in two threads) and a
real :class:`TokenPath` on each: the last rank's and a receiver's. One
thread runs the engine's steps in a tight loop, publish then consume + post,
for each codec (host, with each CPU kernel set, and device on CPU tensors), alternating which goes
first. Each call's thread CPU time, less the CPU the path spent issuing its
collective and in waits (``TokenPath.clock``), is the path's own work:
checks, mask, digest, codec, recorder. Prints the median µs per step.

Why one process: inside a rank process that blocks on its peer every step,
the first numpy call after a wake-up costs several times its hot cost on
these 2 cores (docs/measured.md); the in-rank
figures are ``ppsync bench``'s lockstep and pipelined CPU rows.

``--phases`` runs the host codec alone with a :class:`PhaseTimer` on each
path and prints where the own CPU goes, phase by phase (median µs per step;
see ppsync.bench.phases for what the timers add).
"""

from __future__ import annotations

import argparse
import datetime
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from typing import cast

import numpy as np
import torch
import torch.distributed as dist

from ppsync.bench.common import FixedStep, cpu_now, fixed_step
from ppsync.bench.loopback import LoopbackLink
from ppsync.bench.phases import PhaseTimer, clock_overhead_ns, phase_table
from ppsync.bench.stats import pct_us
from ppsync.bench.vllm_scheme import VllmHostOps
from ppsync.core.codec.cpu_kernels import numba_error
from ppsync.core.path.token_path import TokenPath
from ppsync.core.wire.transport import TransportClock
from ppsync.harness.fresh import in_fresh_process
from ppsync.schemas.bench import BenchOptions
from ppsync.schemas.config import CpuKernelsName, SyncConfig


def gloo_pair(timeout_s: float = 30.0) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """Both ranks of one two-rank gloo group, in this process: (rank 0, rank 1)."""
    store = dist.HashStore()  # type: ignore[attr-defined]
    made: list[dist.ProcessGroup | None] = [None, None]
    errors: list[BaseException] = []

    def make(rank: int) -> None:
        try:
            # a gloo backend serves as the group: TokenPath calls only what
            # both have (rank, size, broadcast, allgather, set_timeout)
            made[rank] = cast(dist.ProcessGroup, dist.ProcessGroupGloo(
                store, rank, 2, datetime.timedelta(seconds=timeout_s)))
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=make, args=(r,), daemon=True) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s)
    if errors or made[0] is None or made[1] is None:
        raise RuntimeError(f"a one-process gloo pair could not be made: {errors}")
    return made[0], made[1]


@contextmanager
def path_pair(config: SyncConfig, device: torch.device | None = None
              ) -> Iterator[tuple[TokenPath, TokenPath]]:
    """(last rank, receiver) real token paths of ``config`` (pp_size 2) on a
    one-process gloo pair, each with a TransportClock; drained and closed
    on exit. ``device``: where the device codec's tensors live (CPU)."""
    receiver_group, last_group = gloo_pair(config.timeout_s)
    paths = [TokenPath(config, g, board=None, wait_handshake=False, device=device)
             for g in (last_group, receiver_group)]
    link = LoopbackLink()
    for path in paths:
        path.finish_handshake()  # on the gloo pair
        path.clock = TransportClock()
        path.transport = link.end(last=path.is_last)  # type: ignore[assignment]
    last, receiver = paths
    try:
        yield last, receiver
    finally:
        for _ in range(config.depth):
            receiver.consume()
        last.close()
        receiver.close()


def _timed(path: TokenPath, call: Callable[[], object]) -> int:
    """Own CPU ns of one call: its thread CPU time less issue and waits."""
    clock = path.clock
    assert clock is not None
    before = clock.total()
    t0 = cpu_now()
    call()
    return cpu_now() - t0 - (clock.total() - before)


def _step_calls(last: TokenPath, receiver: TokenPath, step: FixedStep
                ) -> tuple[Callable[[], object], Callable[[], object]]:
    """One engine step of the fixed batch: (last rank's publish, receiver's
    consume then post)."""
    def publish() -> object:
        return last.publish(step.view, step.sampled())

    def take_post() -> object:
        receiver.consume()
        return receiver.post(step.view)
    return publish, take_post


QUIET_BLOCK = 250
"""Steps per block of :func:`quiet_median`."""


def quiet_median(ns: list[int], block: int = QUIET_BLOCK) -> float:
    """µs: the median of the quietest block of ``block`` consecutive steps.
    This machine's speed drifts over seconds (other tenants; docs/measured.md
    gives the range of block medians in one run), so the quietest block's
    median is the path's cost (as ``timeit`` takes a minimum) and a drift
    between two runs does not read as a change."""
    start = _quietest_block(ns, block)
    return pct_us(np.array(ns[start:start + block], dtype=np.int64), 50)


def hot_config(opts: BenchOptions) -> SyncConfig:
    """The two-rank configuration of the hot figure for a bench run's rows
    and K (its cost per rank does not depend on P)."""
    return SyncConfig.build(pp_size=2, max_num_reqs=opts.max_num_reqs or opts.rows,
                            num_speculative_steps=opts.spec, timeout_s=opts.timeout_s)


def path_cpu(configs: dict[str, SyncConfig], iters: int, *, vllm: bool = False
             ) -> tuple[dict[str, float], dict[str, float]]:
    """:func:`hot_path_cpu` in a fresh process."""
    return in_fresh_process(hot_path_cpu, configs, iters, vllm)


def hot_path_cpu(configs: dict[str, SyncConfig], iters: int, vllm: bool = False
                 ) -> tuple[dict[str, float], dict[str, float]]:
    """(last rank, receiver) own CPU µs per step of real token paths, one
    pair per entry of ``configs`` (pp_size 2), hot: a tight loop in one
    process; each figure is :func:`quiet_median` of the steps after a
    warm-up tenth. What ``ppsync bench`` reports as the hot own-CPU figure.
    With ``vllm``, vLLM's scheme's host calls (ppsync.bench.vllm_scheme, for
    the first config's rows and K) are timed in the same loop, as "vllm"."""
    own: dict[str, tuple[list[int], list[int]]] = {c: ([], []) for c in configs}
    first = next(iter(configs.values()))
    ops = VllmHostOps(fixed_step(first.max_num_reqs, first.num_speculative_steps))
    if vllm:
        own["vllm"] = ([], [])
    with _pairs(configs) as pairs:
        names = list(configs)
        for i in range(iters):
            for name in (names if i % 2 else names[::-1]):
                last, receiver, publish, take_post = pairs[name]
                own[name][0].append(_timed(last, publish))
                own[name][1].append(_timed(receiver, take_post))
            if vllm:
                t0 = cpu_now()
                ops.last_before()
                t1 = cpu_now()
                ops.receiver_after(ops.receiver_before())
                own["vllm"][0].append(t1 - t0)
                own["vllm"][1].append(cpu_now() - t1)
    warm = iters // 10
    med = {c: (quiet_median(a[warm:]), quiet_median(b[warm:])) for c, (a, b) in own.items()}
    return {c: m[0] for c, m in med.items()}, {c: m[1] for c, m in med.items()}


@contextmanager
def _pairs(configs: dict[str, SyncConfig]) -> Iterator[dict[str, tuple[
        TokenPath, TokenPath, Callable[[], object], Callable[[], object]]]]:
    """A path pair per config, with its fixed step's calls."""
    opened: dict[str, tuple[TokenPath, TokenPath, Callable[[], object],
                            Callable[[], object]]] = {}
    with ExitStack() as stack:
        for name, config in configs.items():
            last, receiver = stack.enter_context(path_pair(config))
            step = fixed_step(config.max_num_reqs, config.num_speculative_steps)
            opened[name] = (last, receiver, *_step_calls(last, receiver, step))
        yield opened


def phases(rows: int, spec: int, iters: int, kernels: CpuKernelsName = "numpy"
           ) -> tuple[dict[str, float], dict[str, float]]:
    """:func:`hot_phases` in a fresh process."""
    return in_fresh_process(hot_phases, rows, spec, iters, kernels)


def hot_phases(rows: int, spec: int, iters: int, kernels: CpuKernelsName = "numpy"
               ) -> tuple[dict[str, float], dict[str, float]]:
    """(last rank, receiver) per-phase median µs of the host codec's path
    with the CPU kernels ``kernels``, hot, with a PhaseTimer on each path
    (see ppsync.bench.phases), over each path's quietest block of steps
    (see :func:`quiet_median`). The numpy reference splits digest, pack and
    frame check apart; numba's kernels do each role's work in one call."""
    config = SyncConfig.build(pp_size=2, max_num_reqs=rows, num_speculative_steps=spec,
                              timeout_s=30.0, codec="host", cpu_kernels=kernels)
    out = []
    with path_pair(config) as (last, receiver):
        calls = _step_calls(last, receiver, fixed_step(rows, spec))
        timers = [PhaseTimer(last), PhaseTimer(receiver)]
        samples: list[list[dict[str, int]]] = [[], []]
        totals: list[list[int]] = [[], []]
        for _ in range(iters):
            for k in (0, 1):
                timers[k].reset()
                t0 = cpu_now()
                calls[k]()
                spent = cpu_now() - t0
                ns = timers[k].ns
                totals[k].append(spent - ns.get("issue", 0) - ns.get("wait", 0))
                samples[k].append(dict(ns))
    for k in (0, 1):
        start = _quietest_block(totals[k][iters // 10:]) + iters // 10
        end = start + QUIET_BLOCK
        out.append(phase_table(samples[k][start:end],
                               np.array(totals[k][start:end], dtype=np.int64)))
    return out[0], out[1]


def _quietest_block(ns: list[int], block: int = QUIET_BLOCK) -> int:
    """Start of the block of ``ns`` with the smallest median (see quiet_median)."""
    starts = range(0, max(1, len(ns) - block + 1), block)
    return min(starts, key=lambda i: float(np.median(ns[i:i + block])))


def variants() -> dict[str, dict[str, str]]:
    """The codec and CPU kernel choices compared here: both codecs, and the
    host codec with each kernel set this machine can load."""
    out = {"host / numpy": {"codec": "host", "cpu_kernels": "numpy"}}
    if numba_error() is None:
        out["host / numba"] = {"codec": "host", "cpu_kernels": "numba"}
    out["device"] = {"codec": "device"}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ppsync.bench.codec_cpu",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--spec", type=int, default=2)
    ap.add_argument("--iters", type=int, default=3000)
    ap.add_argument("--phases", action="store_true",
                    help="host codec only, per-phase split of the own CPU")
    ap.add_argument("--kernels", choices=("numpy", "numba"), default="numpy",
                    help="the CPU kernels of --phases (default: the numpy reference)")
    args = ap.parse_args(argv)
    if args.phases:
        last, receiver = phases(args.rows, args.spec, args.iters, args.kernels)
        print(f"host codec ({args.kernels} kernels) own CPU by phase, hot, median µs per "
              f"step (rows={args.rows}, "
              f"K={args.spec}, {args.iters} steps, one process; each timed call adds "
              f"~{2 * clock_overhead_ns() / 1e3:.2f} µs of clock reads)")
        print(f"{'phase':<26} {'last rank':>10} {'receiver':>10}")
        for k in sorted(set(last) | set(receiver), key=lambda k: (k in ("other", "total"), k)):
            print(f"{k:<26} {last.get(k, 0.0):>10.1f} {receiver.get(k, 0.0):>10.1f}")
        return 0
    configs: dict[str, SyncConfig] = {
        name: SyncConfig.build(pp_size=2, max_num_reqs=args.rows,
                               num_speculative_steps=args.spec, timeout_s=30.0, **fields)
        for name, fields in variants().items()
    }
    last, receiver = path_cpu(configs, args.iters, vllm=True)
    print(f"own CPU per step, hot, median µs (rows={args.rows}, K={args.spec}, "
          f"{args.iters} steps, one process)")
    print(f"{'codec / CPU kernels':<22} {'last rank':>10} {'receiver':>10}")
    for c in [*configs, "vllm"]:
        print(f"{c:<22} {last[c]:>10.1f} {receiver[c]:>10.1f}")
    print("vllm: vLLM's scheme's host calls around its broadcasts (ppsync.bench.vllm_scheme)")
    return 0


if __name__ == "__main__":
    from ppsync.bench import codec_cpu

    sys.exit(codec_cpu.main())
