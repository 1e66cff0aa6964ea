"""The ``ppsync`` command.

``ppsync launch`` spawns P local gloo ranks, runs the synthetic workload
through the token path and prints a per-rank table. Exit status: 0 when every
row arrived exactly once and intact, 1 when anything was lost, stale,
duplicated or corrupt (or a rank failed), 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from ppsync.errors import ConfigError, PPSyncError
from ppsync.harness.run import format_table, run_local
from ppsync.schemas.config import SyncConfig


def _at_least(low: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        v = int(text)
        if v < low:
            raise argparse.ArgumentTypeError(f"{v} must be >= {low}")
        return v

    return parse


_positive = _at_least(1)
_non_negative = _at_least(0)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ppsync", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    la = sub.add_parser("launch", help="run the workload over P local gloo ranks")
    la.add_argument("--pp-size", type=_positive, required=True, help="ranks P")
    la.add_argument("--steps", type=_positive, required=True, help="engine steps")
    la.add_argument("--spec", type=int, default=0, help="speculative steps K (default 0)")
    la.add_argument("--max-num-reqs", type=_positive, default=64, help="request slots")
    la.add_argument("--ring-depth", type=_positive, default=None, help="D (default pp_size)")
    la.add_argument("--seed", type=_non_negative, default=0, help="workload seed (>= 0)")
    la.add_argument("--wire", choices=["fixed", "exact"], default="fixed", help="frame sizing")
    la.add_argument("--timeout", type=float, default=30.0, help="bound on every wait (s)")
    la.add_argument("--async", dest="backend", nargs="?", const="asyncio", default=None,
                    choices=["asyncio", "trio"],
                    help="carry tokens through the anyio services (default backend asyncio)")
    la.add_argument("--arrivals", type=_positive, default=4,
                    help="most requests arriving in one step (load; default 4)")
    la.add_argument("--jitter-us", type=float, default=0.0,
                    help="each rank pauses a random 0..N µs per step (slow, jittery ranks)")
    la.add_argument("--report", type=Path, default=None, help="write the run report as JSON")
    be = sub.add_parser("bench", help="time the token path against raw broadcasts and "
                        "today's scheme on P local gloo ranks (lockstep and pipelined)")
    be.add_argument("--pp-size", type=_positive, default=2, help="ranks P (default 2)")
    be.add_argument("--rows", type=_positive, default=256,
                    help="decode rows per step (default 256)")
    be.add_argument("--spec", type=int, default=0, help="speculative steps K (default 0)")
    be.add_argument("--iters", type=_positive, default=None,
                    help="lockstep iterations (default 2000; 200 with --hidden)")
    be.add_argument("--pipelined-iters", type=_positive, default=None,
                    help="measured steps per pipelined scheme (default iters / 2)")
    be.add_argument("--compute-us", type=int, default=400,
                    help="simulated compute per pipelined step, µs (default 400)")
    be.add_argument("--warmup", type=int, default=100, help="warm-up iterations (default 100)")
    be.add_argument("--hidden", type=_bench_shape, default=None, metavar="ROWSxHIDDEN",
                    help="concurrent [ROWS, HIDDEN] float32 send/recv between stages on the "
                    "world group; token traffic runs on the dedicated group and on the world group")
    be.add_argument("--max-num-reqs", type=_positive, default=None,
                    help="request slots, the fixed frame's rows (default: rows)")
    be.add_argument("--timeout", type=float, default=30.0, help="bound on every wait (s)")
    be.add_argument("--json", type=Path, default=None, metavar="FILE",
                    help="write every figure as JSON")
    return p


def _bench_shape(text: str) -> tuple[int, int]:
    parts = text.lower().split("x")
    if len(parts) != 2 or not all(x.strip().isdigit() and int(x) > 0 for x in parts):
        raise argparse.ArgumentTypeError(f"{text!r} must be ROWSxHIDDEN, e.g. 1024x4096")
    return int(parts[0]), int(parts[1])


def _bench(args: argparse.Namespace) -> int:
    from ppsync.bench.runner import BenchOptions, format_tables, run_bench

    iters = args.iters or (200 if args.hidden else 2000)
    opts = BenchOptions.build(
        pp_size=args.pp_size, rows=args.rows, spec=args.spec, iters=iters,
        pipelined_iters=args.pipelined_iters or max(1, iters // 2),
        compute_us=args.compute_us, warmup=args.warmup, hidden=args.hidden,
        max_num_reqs=args.max_num_reqs, timeout_s=args.timeout,
    )
    report = run_bench(opts)
    print(format_tables(report))
    if args.json is not None:
        args.json.write_text(report.model_dump_json(indent=2) + "\n")
    return 0


def _launch(args: argparse.Namespace) -> int:
    config = SyncConfig.build(
        pp_size=args.pp_size,
        max_num_reqs=args.max_num_reqs,
        num_speculative_steps=args.spec,
        ring_depth=args.ring_depth,
        timeout_s=args.timeout,
        wire=args.wire,
    )
    if args.jitter_us < 0:
        raise ConfigError(f"--jitter-us = {args.jitter_us} must be >= 0")
    report = run_local(config, steps=args.steps, seed=args.seed, backend=args.backend,
                       jitter_us=args.jitter_us, knobs={"max_arrivals": args.arrivals})
    print(format_table(report))
    if args.report is not None:
        args.report.write_text(report.model_dump_json(indent=2) + "\n")
    return 0 if report.ok else 1


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "launch":
            return _launch(args)
        if args.command == "bench":
            return _bench(args)
    except ConfigError as e:
        print(f"ppsync: {e}", file=sys.stderr)
        return 2
    except PPSyncError as e:
        print(f"ppsync: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    return 2


if __name__ == "__main__":
    sys.exit(main())
