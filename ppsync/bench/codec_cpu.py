"""The codecs' own CPU per step, host (numpy) next to device (torch ops) on
CPU tensors, measured on the real token path:

    python -m ppsync.bench.codec_cpu [--rows 256] [--spec 2] [--iters 3000]

Two local gloo ranks run one fixed decode step of ``rows`` rows on two
token paths side by side, one per codec, alternating which goes first. Each
call's thread CPU time, less the CPU the path spent issuing its collective
and in waits (``TokenPath.clock``), is the codec's own work plus the rest of
the path (checks, mask, digest, recorder): last rank ``publish``; receiver
``consume`` + ``post``. Prints the median µs per step of each.

``--phases`` runs the host codec alone with a :class:`PhaseTimer` on its
path and prints where the own CPU goes, phase by phase (median µs per step;
see ppsync.bench.phases for what the timers add).
"""

from __future__ import annotations

import argparse
import functools
import sys

import numpy as np
import torch.distributed as dist

from ppsync.bench.common import FixedStep, cpu_now, fixed_step
from ppsync.bench.model import pct_us
from ppsync.bench.phases import PhaseTimer, clock_overhead_ns, phase_table
from ppsync.core.groups import token_group
from ppsync.core.handler import TokenPath
from ppsync.core.transport import TransportClock
from ppsync.harness.launcher import RankEnv, spawn_ranks
from ppsync.schemas.config import CodecName, SyncConfig

CODECS: tuple[CodecName, ...] = ("host", "device")


def _step(path: TokenPath, step: FixedStep) -> None:
    """One engine step of the fixed batch: publish on the last rank, consume
    then post on a receiver."""
    if path.is_last:
        path.publish(step.view, step.tokens, step.num_sampled, step.num_rejected, step.drafts)
    else:
        path.consume()
        path.post(step.view)


def _rank(configs: dict[str, SyncConfig], iters: int, env: RankEnv) -> dict[str, float]:
    group = token_group(dist.group.WORLD, timeout_s=30.0)  # type: ignore[arg-type]
    paths = {c: TokenPath(config, group, board=None) for c, config in configs.items()}
    for path in paths.values():
        path.clock = TransportClock()
    first = next(iter(configs.values()))
    step = fixed_step(first.max_num_reqs, first.num_speculative_steps)
    codecs = list(configs)
    own: dict[str, list[int]] = {c: [] for c in codecs}
    for i in range(iters):
        for codec in (codecs if i % 2 else codecs[::-1]):
            path = paths[codec]
            clock = path.clock
            assert clock is not None
            before = clock.total()
            t0 = cpu_now()
            _step(path, step)
            own[codec].append(cpu_now() - t0 - (clock.total() - before))
    for path in paths.values():
        if not path.is_last:
            for _ in range(path.config.depth):
                path.consume()
        path.close()
    warm = iters // 10
    return {c: pct_us(np.array(v[warm:], dtype=np.int64), 50) for c, v in own.items()}


def path_cpu(configs: dict[str, SyncConfig], iters: int) -> tuple[dict[str, float],
                                                                   dict[str, float]]:
    """(last rank, slowest receiver) median own CPU µs per step of real token
    paths, one per entry of ``configs`` (same pp_size and rows), on
    ``pp_size`` local gloo ranks: what ``ppsync bench`` reports as the hot
    own-CPU figure (a tight loop, no compute between steps)."""
    size = next(iter(configs.values())).pp_size
    per_rank = spawn_ranks(functools.partial(_rank, configs, iters), size, timeout_s=120.0)
    receivers = per_rank[:-1]
    return per_rank[-1], {c: max(r[c] for r in receivers) for c in configs}


def _phases_rank(rows: int, spec: int, iters: int, env: RankEnv) -> dict[str, float]:
    """The host codec's path with every phase timed (see ppsync.bench.phases)."""
    config = SyncConfig.build(pp_size=2, max_num_reqs=rows, num_speculative_steps=spec,
                              timeout_s=30.0, codec="host")
    group = token_group(dist.group.WORLD, timeout_s=30.0)  # type: ignore[arg-type]
    path = TokenPath(config, group, board=None)
    timer = PhaseTimer(path)
    step = fixed_step(rows, spec)
    samples: list[dict[str, int]] = []
    totals: list[int] = []
    try:
        for _ in range(iters):
            timer.reset()
            t0 = cpu_now()
            _step(path, step)
            spent = cpu_now() - t0
            totals.append(spent - timer.ns.get("issue", 0) - timer.ns.get("wait", 0))
            samples.append(dict(timer.ns))
        if not path.is_last:
            path.consume()
            path.consume()
        path.close()
    finally:
        timer.remove()
    warm = iters // 10
    return phase_table(samples[warm:], np.array(totals[warm:], dtype=np.int64))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ppsync.bench.codec_cpu",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--spec", type=int, default=2)
    ap.add_argument("--iters", type=int, default=3000)
    ap.add_argument("--phases", action="store_true",
                    help="host codec only, per-phase split of the own CPU")
    args = ap.parse_args(argv)
    if args.phases:
        receiver, last = spawn_ranks(
            functools.partial(_phases_rank, args.rows, args.spec, args.iters), 2,
            timeout_s=120.0)
        print(f"host codec own CPU by phase, median µs per step (rows={args.rows}, "
              f"K={args.spec}, {args.iters} steps, 2 gloo ranks; each timed call adds "
              f"~{2 * clock_overhead_ns() / 1e3:.2f} µs of clock reads)")
        print(f"{'phase':<26} {'last rank':>10} {'receiver':>10}")
        for k in sorted(set(last) | set(receiver), key=lambda k: (k in ("other", "total"), k)):
            print(f"{k:<26} {last.get(k, 0.0):>10.1f} {receiver.get(k, 0.0):>10.1f}")
        return 0
    configs: dict[str, SyncConfig] = {
        c: SyncConfig.build(pp_size=2, max_num_reqs=args.rows, num_speculative_steps=args.spec,
                            timeout_s=30.0, codec=c)
        for c in CODECS
    }
    last, receiver = path_cpu(configs, args.iters)
    print(f"own CPU per step, median µs (rows={args.rows}, K={args.spec}, "
          f"{args.iters} steps, 2 gloo ranks)")
    print(f"{'codec':<8} {'last rank':>10} {'receiver':>10}")
    for c in CODECS:
        print(f"{c:<8} {last[c]:>10.1f} {receiver[c]:>10.1f}")
    return 0


if __name__ == "__main__":
    from ppsync.bench import codec_cpu

    sys.exit(codec_cpu.main())
