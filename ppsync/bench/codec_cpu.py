"""The codecs' own CPU per step, host (numpy) next to device (torch ops) on
CPU tensors, measured on the real token path:

    python -m ppsync.bench.codec_cpu [--rows 256] [--spec 2] [--iters 3000]

Two local gloo ranks run one fixed decode step of ``rows`` rows on two
token paths side by side, one per codec, alternating which goes first. Each
call's thread CPU time, less the CPU the path spent issuing its collective
and in waits (``TokenPath.clock``), is the codec's own work plus the rest of
the path (checks, mask, digest, recorder): last rank ``publish``; receiver
``consume`` + ``post``. Prints the median µs per step of each.
"""

from __future__ import annotations

import argparse
import functools
import sys

import numpy as np
import torch.distributed as dist

from ppsync.bench.common import cpu_now, fixed_step
from ppsync.bench.model import pct_us
from ppsync.core.groups import token_group
from ppsync.core.handler import TokenPath
from ppsync.core.transport import TransportClock
from ppsync.harness.launcher import RankEnv, spawn_ranks
from ppsync.schemas.config import CodecName, SyncConfig

CODECS: tuple[CodecName, ...] = ("host", "device")


def _rank(rows: int, spec: int, iters: int, env: RankEnv) -> dict[str, float]:
    paths: dict[str, TokenPath] = {}
    for codec in CODECS:
        config = SyncConfig.build(pp_size=2, max_num_reqs=rows, num_speculative_steps=spec,
                                  timeout_s=30.0, codec=codec)
        group = token_group(dist.group.WORLD, timeout_s=30.0)  # type: ignore[arg-type]
        paths[codec] = TokenPath(config, group, board=None)
        paths[codec].clock = TransportClock()
    step = fixed_step(rows, spec)
    own: dict[str, list[int]] = {c: [] for c in CODECS}
    for i in range(iters):
        for codec in (CODECS if i % 2 else CODECS[::-1]):
            path = paths[codec]
            clock = path.clock
            assert clock is not None
            before = clock.total()
            t0 = cpu_now()
            if path.is_last:
                path.publish(step.view, step.tokens, step.num_sampled, step.num_rejected,
                             step.drafts)
            else:
                path.consume()
                path.post(step.view)
            own[codec].append(cpu_now() - t0 - (clock.total() - before))
    for path in paths.values():
        if not path.is_last:
            path.consume()
            path.consume()
        path.close()
    warm = iters // 10
    return {c: pct_us(np.array(v[warm:], dtype=np.int64), 50) for c, v in own.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ppsync.bench.codec_cpu",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--spec", type=int, default=2)
    ap.add_argument("--iters", type=int, default=3000)
    args = ap.parse_args(argv)
    receiver, last = spawn_ranks(functools.partial(_rank, args.rows, args.spec, args.iters),
                                 2, timeout_s=120.0)
    print(f"own CPU per step, median µs (rows={args.rows}, K={args.spec}, "
          f"{args.iters} steps, 2 gloo ranks)")
    print(f"{'codec':<8} {'last rank':>10} {'receiver':>10}")
    for c in CODECS:
        print(f"{c:<8} {last[c]:>10.1f} {receiver[c]:>10.1f}")
    return 0


if __name__ == "__main__":
    from ppsync.bench import codec_cpu

    sys.exit(codec_cpu.main())
