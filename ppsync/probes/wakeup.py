"""What the event loop pays to learn that a gloo transfer completed:

    python -m ppsync.probes.wakeup [--iters 4000] [--block 100] [--backend asyncio]

Two local gloo ranks ping-pong a small broadcast (rank 0 sends, then rank 1),
each rank awaiting every transfer with ``ppsync.services.awaiting.await_work``
on its event loop. Blocks of ``--block`` round trips alternate between the
inline wait off (``INLINE_WAIT_S = 0``: every pending wait is handed to the
loop by the done-callback) and on (the module's bound). Prints the median µs
per transfer of each, and how many waits ended inline; the difference is what
the hand-off costs per wait on this machine.
"""

from __future__ import annotations

import argparse
import functools
import sys

import anyio
import numpy as np
import torch

from ppsync.bench.common import now, world_group
from ppsync.core.wire.transport import broadcast_async
from ppsync.harness.launcher import RankEnv, spawn_ranks
from ppsync.services import awaiting

TIMEOUT_S = 30.0


def _rank(iters: int, block: int, backend: str, bound_s: float, env: RankEnv) -> dict[str, float]:
    group = world_group()
    buf = torch.zeros(64, dtype=torch.int64)
    bounds = {"off": 0.0, "on": bound_s}
    default = awaiting.INLINE_WAIT_S
    per: dict[str, list[float]] = {k: [] for k in bounds}
    ended = {k: 0 for k in bounds}
    reached = {k: 0 for k in bounds}
    inline_wait = awaiting.inline_wait
    mode = ["off"]

    def counted(flag: object, bound_s: float) -> bool:
        reached[mode[0]] += 1
        done = inline_wait(flag, bound_s)  # type: ignore[arg-type]
        ended[mode[0]] += done
        return done

    awaiting.inline_wait = counted

    async def main() -> None:
        for b in range(iters // block):
            mode[0] = ("off", "on")[b % 2]
            awaiting.INLINE_WAIT_S = bounds[mode[0]]
            t0 = now()
            for _ in range(block):
                for src in (0, 1):
                    work = broadcast_async(buf, src, group)
                    await awaiting.await_work(work, timeout_s=TIMEOUT_S, what="bench: ping")
            per[mode[0]].append((now() - t0) / (2 * block) / 1e3)

    try:
        anyio.run(main, backend=backend)
    finally:
        awaiting.inline_wait = inline_wait
        awaiting.INLINE_WAIT_S = default
    out = {f"{k}_us": float(np.median(v[1:])) for k, v in per.items()}
    out.update({f"{k}_reached": float(reached[k]) for k in bounds})
    out.update({f"{k}_ended_inline": float(ended[k]) for k in bounds})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ppsync.probes.wakeup",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--iters", type=int, default=4000)
    ap.add_argument("--block", type=int, default=100)
    ap.add_argument("--backend", choices=("asyncio", "trio"), default="asyncio")
    ap.add_argument("--bound-us", type=float, default=awaiting.INLINE_WAIT_S * 1e6,
                    help="the inline bound of the 'on' blocks (default: the module's)")
    args = ap.parse_args(argv)
    results = spawn_ranks(functools.partial(_rank, args.iters, args.block, args.backend,
                                             args.bound_us / 1e6), 2,
                          timeout_s=120.0)
    print(f"per transfer, median µs over blocks of {args.block} round trips "
          f"({args.iters} in all, {args.backend}, 2 gloo ranks; inline bound "
          f"{args.bound_us:.0f} µs)")
    for rank, r in enumerate(results):
        print(f"rank {rank}: inline off {r['off_us']:.1f}  on {r['on_us']:.1f}  "
              f"(on: {r['on_ended_inline']:.0f} of {r['on_reached']:.0f} pending waits "
              "ended inline)")
    return 0


if __name__ == "__main__":
    from ppsync.probes import wakeup

    sys.exit(wakeup.main())
