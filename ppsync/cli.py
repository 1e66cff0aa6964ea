"""The ``ppsync`` command (also ``python -m ppsync``).

``ppsync run`` is one rank, placed in the world by torchrun's environment
(RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT); ``ppsync launch``
spawns the same rank code as local processes. Both run the synthetic workload
through the token path and print one per-rank table (rank 0 prints it under
``run``). Exit status, on every rank: 0 when every row arrived exactly once
and intact, 1 when anything was lost, stale, duplicated or corrupt (or a rank
failed), 2 on bad arguments or environment.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, get_args

import torch
import torch.distributed as dist

from ppsync.core.codec import check_frames
from ppsync.core.completion import EMULATED, StreamOrdered
from ppsync.core.device_kernels import resolve_device_kernels
from ppsync.core.dumps import dump_all, install_dump_triggers
from ppsync.core.host_kernels import resolve_host_kernels
from ppsync.debug.cli import add_debug_commands, point_at_dumps
from ppsync.errors import ConfigError, PPSyncError
from ppsync.harness.rank import RunOptions, run_rank
from ppsync.harness.run import format_table, run_local
from ppsync.harness.world import WorldEnv, joining
from ppsync.schemas.config import (
    DEFAULT_TIMEOUT_S,
    DeviceKernelsName,
    HostKernelsName,
    SyncConfig,
)
from ppsync.schemas.dump import DUMP_DIR_ENV
from ppsync.schemas.report import RunReport


class _Help(argparse.HelpFormatter):
    """Every option's help ends with its default, unless it says one itself."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if ("default" in text or not action.option_strings or action.required
                or action.default is False or action.default == argparse.SUPPRESS):
            return text
        return f"{text} (default: {'none' if action.default is None else '%(default)s'})"


class _Parser(argparse.ArgumentParser):
    """A parser whose subcommands' parsers show their defaults too."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", _Help)
        super().__init__(*args, **kwargs)


def _at_least(low: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        v = int(text)
        if v < low:
            raise argparse.ArgumentTypeError(f"{v} must be >= {low}")
        return v

    return parse


_positive = _at_least(1)
_non_negative = _at_least(0)


def _seconds(text: str) -> float:
    v = float(text)
    if not v > 0:
        raise argparse.ArgumentTypeError(f"{v} must be > 0 seconds")
    return v


def _workload_flags(la: argparse.ArgumentParser) -> None:
    """The flags ``launch`` and ``run`` share (one place for new ones)."""
    la.add_argument("--steps", type=_positive, required=True, help="engine steps")
    la.add_argument("--spec", type=int, default=0, help="speculative steps K")
    la.add_argument("--max-num-reqs", type=_positive, default=64, help="request slots")
    la.add_argument("--ring-depth", type=_positive, default=None, help="D (default pp_size)")
    la.add_argument("--seed", type=_non_negative, default=0, help="workload seed (>= 0)")
    la.add_argument("--wire", choices=["fixed", "exact"], default="fixed", help="frame sizing")
    la.add_argument("--codec", choices=["host", "device"], default="host",
                    help="frame codec: host (numpy, the CPU default) or device (torch ops, "
                    "checks deferred one step; runs on CPU tensors here)")
    la.add_argument("--device-kernels", choices=get_args(DeviceKernelsName), default="auto",
                    help="the device codec's kernels: triton, torch (ops) or auto (Triton on "
                    "CUDA/XPU where it imports, else torch)")
    la.add_argument("--host-kernels", choices=get_args(HostKernelsName), default="auto",
                    help="the host codec's kernels: numba, numpy or auto (numba where it "
                    "loads, else numpy)")
    la.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S,
                    help="bound on every wait (s)")
    la.add_argument("--async", dest="backend", nargs="?", const="asyncio", default=None,
                    choices=["asyncio", "trio"],
                    help="carry tokens through the anyio services (backend asyncio when "
                    "none is named)")
    la.add_argument("--arrivals", type=_positive, default=4,
                    help="most requests arriving in one step (load)")
    la.add_argument("--jitter-us", type=float, default=0.0,
                    help="each rank pauses a random 0..N µs per step (slow, jittery ranks)")
    la.add_argument("--report", type=Path, default=None, help="write the run report as JSON")
    la.add_argument("--emulate", choices=list(EMULATED), default=None,
                    help="token groups whose works behave as this backend's (the CPU twin of "
                         "stream-ordered backends; needs --codec device and --wire fixed)")
    la.add_argument("--join-timeout", type=_seconds, default=120.0, metavar="S",
                    help="bound on joining the world: ranks may start seconds apart")
    la.add_argument("--progress-every", type=_seconds, default=5.0, metavar="S",
                    help="rank 0 prints steps done, steps/s and ETA to stderr every S seconds")
    la.add_argument("--quiet", action="store_true", help="no progress line")
    la.add_argument("--flight-events", type=_non_negative, default=4096, metavar="N",
                    help="events each rank's flight recorder keeps (0 = off)")
    la.add_argument("--dump-dir", type=Path, default=None, metavar="DIR",
                    help="ranks dump their flight records here on an error, on SIGUSR1 and "
                    f"at exit (default ${DUMP_DIR_ENV}; unset: no dumps)")


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="ppsync", description=__doc__.split("\n\n")[0].replace("``", ""))
    sub = p.add_subparsers(dest="command", required=True)
    la = sub.add_parser("launch", help="run the workload over P local gloo ranks")
    la.add_argument("--pp-size", type=_positive, required=True, help="ranks P per PP group")
    la.add_argument("--world-size", type=_positive, default=None,
                    help="ranks in all (default pp_size; a multiple: tensor x pipeline)")
    _workload_flags(la)
    ru = sub.add_parser("run", help="one rank from torchrun's environment (RANK, WORLD_SIZE, "
                        "LOCAL_RANK, MASTER_ADDR, MASTER_PORT); rank 0 prints the table")
    ru.add_argument("--device", choices=["cpu", "cuda", "xpu"], default="cpu",
                    help="where each rank's tensors live: cuda / xpu use the accelerator at "
                    "LOCAL_RANK (modulo the visible count) and token groups on nccl / xccl; "
                    "needs --codec device")
    ru.add_argument("--pp-size", type=_positive, default=None,
                    help="ranks P per PP group (default WORLD_SIZE; a divisor of it: "
                    "tensor x pipeline)")
    ru.add_argument("--run-id", default=None, metavar="ID",
                    help="name of this run in the store: every rank gives the same one "
                    "(default torchrun's TORCHELASTIC_RUN_ID; without either, each rank "
                    "counts its runs on the store); keys of other runs are never read")
    _workload_flags(ru)
    be = sub.add_parser("bench", help="time the token path against raw broadcasts and "
                        "today's scheme on P local gloo ranks (lockstep and pipelined)")
    be.add_argument("--pp-size", type=_positive, default=2, help="ranks P")
    be.add_argument("--rows", type=_positive, default=256,
                    help="decode rows per step")
    be.add_argument("--spec", type=int, default=0, help="speculative steps K")
    be.add_argument("--iters", type=_positive, default=None,
                    help="lockstep iterations (default 2000; 200 with --hidden)")
    be.add_argument("--pipelined-iters", type=_positive, default=None,
                    help="measured steps per pipelined scheme (default iters / 2)")
    be.add_argument("--compute-us", type=int, default=400,
                    help="simulated compute per pipelined step, µs")
    be.add_argument("--warmup", type=int, default=100, help="warm-up iterations")
    be.add_argument("--hidden", type=_bench_shape, default=None, metavar="ROWSxHIDDEN",
                    help="concurrent [ROWS, HIDDEN] float32 send/recv between stages on the "
                    "world group; token traffic runs on the dedicated group and on the world group")
    be.add_argument("--max-num-reqs", type=_positive, default=None,
                    help="request slots, the fixed frame's rows (default: rows)")
    be.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S,
                    help="bound on every wait (s)")
    be.add_argument("--json", type=Path, default=None, metavar="FILE",
                    help="write every figure as JSON")
    vc = sub.add_parser("vllm-check", help="run the installed vLLM twice at "
                        "pipeline_parallel_size 2 on a small dummy model, with vLLM's own "
                        "PPHandler and with ppsync's plugin: the handler each worker built, "
                        "whether the tokens are identical, the time per generate and receive "
                        "(0 pass, 1 fail, 2 no vLLM here: `make vllm-check`)")
    vc.add_argument("--pp-size", type=_at_least(2), default=2, help="pipeline stages")
    vc.add_argument("--prompts", type=_positive, default=4, help="prompts")
    vc.add_argument("--max-tokens", type=_positive, default=12,
                    help="new tokens per prompt")
    vc.add_argument("--repeat", type=_positive, default=2,
                    help="generate calls per run, each on every prompt")
    vc.add_argument("--seed", type=_non_negative, default=0,
                    help="seed of the prompts and of the dummy weights")
    vc.add_argument("--hidden", type=_at_least(64), default=128,
                    help="the model's hidden size, a multiple of 32")
    vc.add_argument("--layers-per-stage", type=_positive, default=2,
                    help="decoder layers per pipeline stage")
    vc.add_argument("--timeout", type=_seconds, default=900.0, metavar="S",
                    help="bound on each vLLM run (s)")
    vc.add_argument("--work-dir", type=Path, default=None, metavar="DIR",
                    help="where the model config, vLLM's logs and the records go "
                    "(default: a new temporary directory, kept)")
    add_debug_commands(sub)
    return p


def _vllm_check(args: argparse.Namespace) -> int:
    from ppsync.harness.vllm_check import VllmCheckOptions, run_check

    if args.hidden % 32:
        raise ConfigError(f"--hidden = {args.hidden} must be a multiple of 32 (the head size)")
    return run_check(VllmCheckOptions(
        pp_size=args.pp_size, prompts=args.prompts, max_tokens=args.max_tokens,
        repeat=args.repeat, seed=args.seed, hidden=args.hidden,
        layers_per_stage=args.layers_per_stage, timeout_s=args.timeout,
        work_dir=args.work_dir))


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


def _config(args: argparse.Namespace, pp_size: int) -> SyncConfig:
    if args.jitter_us < 0:
        raise ConfigError(f"--jitter-us = {args.jitter_us} must be >= 0")
    config = SyncConfig.build(
        pp_size=pp_size,
        max_num_reqs=args.max_num_reqs,
        num_speculative_steps=args.spec,
        ring_depth=args.ring_depth,
        timeout_s=args.timeout,
        wire=args.wire,
        codec=args.codec,
        device_kernels=args.device_kernels,
        host_kernels=args.host_kernels,
        flight_events=args.flight_events,
    )
    if args.emulate is not None:  # before any rank starts
        check_frames(config, StreamOrdered(), f"gloo emulating {args.emulate}")
    # a kernel set named outright that cannot run here: a bad argument (exit 2)
    # before any rank starts ("auto" always resolves)
    if config.host_kernels != "auto":
        resolve_host_kernels(config)
    if config.codec == "device" and config.device_kernels != "auto":
        resolve_device_kernels(config, torch.device(getattr(args, "device", "cpu")))
    return config


def _dump_dir(args: argparse.Namespace) -> Path | None:
    """--dump-dir, else $PPSYNC_DUMP_DIR, else None (no dumps)."""
    if args.dump_dir is not None:
        return Path(args.dump_dir)
    env = os.environ.get(DUMP_DIR_ENV)
    return Path(env) if env else None


def _check_report_path(args: argparse.Namespace) -> None:
    """--report FILE must be writable before the run starts (a bad argument,
    exit 2), not found out once the run is done."""
    f: Path | None = args.report
    if f is None:
        return
    if f.is_dir():
        raise ConfigError(f"--report {f}: is a directory; give a file to write the report to")
    parent = f.parent if str(f.parent) else Path(".")
    if not parent.is_dir():
        raise ConfigError(f"--report {f}: directory {parent} does not exist")
    if not os.access(parent, os.W_OK) or (f.exists() and not os.access(f, os.W_OK)):
        raise ConfigError(f"--report {f}: not writable")


def _finish(args: argparse.Namespace, report: RunReport) -> int:
    print(format_table(report), flush=True)
    if args.report is not None:
        try:
            args.report.write_text(report.model_dump_json(indent=2) + "\n")
        except OSError as e:
            print(f"ppsync: --report {args.report}: not written: {e.strerror or e}",
                  file=sys.stderr)
            return 1
    if not report.ok:
        point_at_dumps(_dump_dir(args))
    return 0 if report.ok else 1


def _launch(args: argparse.Namespace) -> int:
    config = _config(args, args.pp_size)
    _check_report_path(args)
    dump_dir = _dump_dir(args)
    try:
        report = run_local(config, steps=args.steps, seed=args.seed, backend=args.backend,
                           jitter_us=args.jitter_us, knobs={"max_arrivals": args.arrivals},
                           world_size=args.world_size,
                           progress_s=None if args.quiet else args.progress_every,
                           dump_dir=dump_dir, emulate=args.emulate)
    except ConfigError:
        raise
    except PPSyncError as e:  # the dumps' pointers are the last lines
        print(f"ppsync: {type(e).__name__}: {e}", file=sys.stderr)
        point_at_dumps(dump_dir)
        return 1
    return _finish(args, report)


def _run(args: argparse.Namespace) -> int:
    # a stuck rank prints every thread's stack on SIGUSR1 (to stderr, fd 2) and,
    # with a dump directory, dumps its flight record (also on an error, at exit)
    install_dump_triggers(_dump_dir(args))
    signal.signal(signal.SIGTERM, _stopped)
    world = WorldEnv.from_environ(os.environ)
    config = _config(args, args.pp_size or world.world_size)
    if world.rank == 0:
        _check_report_path(args)
    opts = RunOptions(args.steps, args.seed, args.backend, args.jitter_us,
                      {"max_arrivals": args.arrivals},
                      None if args.quiet else args.progress_every, args.join_timeout,
                      args.device, args.run_id, args.emulate)
    report = run_rank(config, opts, world)
    if world.rank == 0:
        return _finish(args, report)
    return 0 if report.ok else 1


def _stopped(signum: int, frame: object) -> None:
    """SIGTERM: torchrun's agent stops every worker as soon as one fails (its
    summary names the failed one), as do container engines; say so and exit 1."""
    rank = os.environ.get("RANK", "?")
    where = " while joining the world" if joining() else ""
    print(f"ppsync: rank {rank}: stopped by {signal.Signals(signum).name}{where} (the launcher "
          "ends the run: a peer failed, or it was asked to stop)", file=sys.stderr, flush=True)
    dump_all("signal")  # os._exit skips atexit; no-op without a dump directory
    sys.stdout.flush()
    os._exit(1)


def _dispatch(args: argparse.Namespace) -> int:
    try:
        if args.command == "launch":
            return _launch(args)
        if args.command == "run":
            return _run(args)
        if args.command == "bench":
            return _bench(args)
        if args.command == "vllm-check":
            return _vllm_check(args)
        if args.command in ("dump", "schema"):
            return int(args.run(args))
    except ConfigError as e:
        print(f"ppsync: {e}", file=sys.stderr)
        return 2
    except PPSyncError as e:
        print(f"ppsync: {_who(args)}{type(e).__name__}: {e}", file=sys.stderr)
        if args.command == "run":
            point_at_dumps(_dump_dir(args))
        return 1
    except Exception as e:  # a rank of `run` whose world broke (gloo, the store)
        if args.command != "run":
            raise
        print(f"ppsync: {_who(args)}{type(e).__name__}: {e}", file=sys.stderr)
        return 1
    return 2


def _who(args: argparse.Namespace) -> str:
    rank = os.environ.get("RANK") if args.command == "run" else None
    return f"rank {rank}: " if rank is not None else ""


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    code = _dispatch(args)
    if dist.is_initialized():
        # this process joined a gloo world (`run`): after a failed collective
        # gloo's threads can abort the interpreter's exit (rc 134), so leave now
        dump_all("exit")  # os._exit skips atexit; no-op without a dump directory
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
