"""What the ``ppsync`` command does once its arguments are parsed.

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
import contextlib
import os
import re
import signal
import sys
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from pydantic import BaseModel

from ppsync.checks.vllm.healthy import HEALTHY
from ppsync.cli.parser import IDLE_S, PP_SIZE_ONE, SLOW_S
from ppsync.core.codec import check_frames
from ppsync.core.codec.cpu_kernels import resolve_cpu_kernels
from ppsync.core.codec.device_kernels import resolve_device_kernels
from ppsync.core.recorder.registry import check_dump_dir
from ppsync.core.recorder.triggers import dump_all, install_dump_triggers
from ppsync.core.wire.completion import HostCompleted, StreamOrdered
from ppsync.core.wire.groups import pipeline_groups
from ppsync.debug.cli import dump_files, point_at_dumps
from ppsync.debug.paths import check_output_file
from ppsync.errors import ConfigError, PPSyncError, Stopped
from ppsync.harness.local_run import format_table, run_local
from ppsync.harness.rank import RunOptions, rank_device, run_rank
from ppsync.harness.world import WorldEnv, joining
from ppsync.schemas.config import SyncConfig, frames_on_device
from ppsync.schemas.dump import DUMP_DIR_ENV
from ppsync.schemas.run_report import RunReport

SPEC_MAX_TOKENS = 32  # --max-tokens' default with --spec: room for drafts to be accepted
FAULT_MAX_TOKENS = 64  # with --fault: generate still running at the fault
MISMATCH_TIMEOUT_S = 20.0  # with --mismatch: the start-up agreement's bound


def _vllm_check(args: argparse.Namespace) -> int:
    from ppsync.checks.vllm import VllmCheckOptions, run_check
    from ppsync.compat.vllm.settings import settings_from_env

    if args.hidden % 32:
        raise ConfigError(f"--hidden = {args.hidden} must be a multiple of 32 (the head size)")
    if args.fault is not None and args.repeat > 1:
        raise ConfigError("--fault and --repeat: one at a time (a fault run is not timed)")
    check_nodes_arguments(args)
    check_healthy_arguments(args)
    # a fault that ends the engine: one long generate call, under way at the fault;
    # a healthy one (slow-last, idle) runs as the plain check does
    fault = args.fault is not None and args.fault not in HEALTHY
    settings = tuple((name, value) for name, value in (
        ("PPSYNC_CODEC", args.codec), ("PPSYNC_CARRIER", args.carrier),
        ("PPSYNC_CPU_KERNELS", args.cpu_kernels),
        ("PPSYNC_DEVICE_KERNELS", args.device_kernels), ("PPSYNC_EMULATE", args.emulate))
        if value is not None)
    # checked as the plugin will check them: a bad combination exits 2 now (the
    # device kernels in the runs, whose TRITON_INTERPRET the check sets)
    settings_from_env({k: v for k, v in settings if k != "PPSYNC_DEVICE_KERNELS"})
    return run_check(VllmCheckOptions(
        pp_size=args.pp_size, prompts=args.prompts,
        max_tokens=args.max_tokens or (FAULT_MAX_TOKENS if fault else
                                       SPEC_MAX_TOKENS if args.spec else 12),
        calls=args.calls or (1 if fault else 3 if args.repeat > 1 else 2), seed=args.seed,
        hidden=args.hidden, layers_per_stage=args.layers_per_stage, timeout_s=args.timeout,
        work_dir=args.work_dir, spec=args.spec, spec_method=args.spec_method,
        settings=settings, handler_timeout_s=args.handler_timeout or (
            MISMATCH_TIMEOUT_S if args.mismatch else None),
        handler_silent_s=args.handler_silent, fault=args.fault, fault_after=args.fault_after,
        fault_bound_s=args.fault_bound, slow_s=args.slow or SLOW_S, idle_s=args.idle or IDLE_S,
        repeat=args.repeat, nodes=args.nodes, mismatch=args.mismatch, requests=args.requests))


def check_healthy_arguments(args: argparse.Namespace) -> None:
    """vllm-check's --slow and --idle: each with its fault; ConfigError naming the flag."""
    for flag, value, fault in (("--slow", args.slow, "slow-last"), ("--idle", args.idle, "idle")):
        if value is not None and args.fault != fault:
            raise ConfigError(f"{flag} = {value:g} needs --fault {fault} (it sets that fault's "
                              "length)")
    if args.fault == "idle" and args.calls is not None and args.calls < 2:
        raise ConfigError(f"--fault idle needs --calls >= 2 (it idles between generate calls); "
                          f"--calls = {args.calls}")


NODE_FAULTS = ("kill-node", "stop-node", "cut-link")


def check_nodes_arguments(args: argparse.Namespace) -> None:
    """vllm-check's --nodes combinations: ConfigError naming the flag and the rule."""
    node_fault = args.fault in NODE_FAULTS
    if args.nodes == 1:
        if node_fault:
            raise ConfigError(f"--fault {args.fault} needs --nodes 2 (it faults a host)")
        if args.mismatch is not None:
            raise ConfigError(f"--mismatch {args.mismatch} needs --nodes 2 (settings per host)")
        return
    if args.fault is not None and not node_fault:
        raise ConfigError(f"--fault {args.fault} is a worker's fault of the one-host check; with "
                          f"--nodes {args.nodes}: {', '.join(NODE_FAULTS)}")
    if args.fault is not None and args.mismatch is not None:
        raise ConfigError("--fault and --mismatch: one at a time")
    if args.pp_size % args.nodes:
        raise ConfigError(f"--pp-size = {args.pp_size} must be a multiple of --nodes = "
                          f"{args.nodes} (the same number of stages on every host)")
    for flag, value, default in (("--spec", args.spec, 0), ("--repeat", args.repeat, 1)):
        if value != default:
            raise ConfigError(f"{flag} = {value} is not run with --nodes {args.nodes} (the "
                              "served check runs without it)")


def _sglang_check(args: argparse.Namespace) -> int:
    from ppsync.checks.sglang import SglangCheckOptions, run_check

    return run_check(SglangCheckOptions(
        cases=args.fault or ["none", "desync"], timeout_s=args.timeout, silent_s=args.silent,
        slow_s=args.slow, hang_s=args.hang, max_tokens=args.max_tokens, work_dir=args.work_dir))


def _bench(args: argparse.Namespace) -> int:
    from ppsync.bench.runner import BenchOptions, format_tables, run_bench

    iters = args.iters or (200 if args.hidden else 2000)
    with flags_named(BENCH_FLAGS):
        opts = BenchOptions.build(
            pp_size=args.pp_size, rows=args.rows, spec=args.spec, iters=iters,
            pipelined_iters=args.pipelined_iters or max(1, iters // 2),
            compute_us=args.compute_us, warmup=args.warmup, hidden=args.hidden,
            max_num_reqs=args.max_num_reqs, timeout_s=args.timeout,
        )
    if args.json is not None:
        check_output_file("--json", args.json)
    report = run_bench(opts)
    print(format_tables(report))
    return 0 if _write_json("--json", args.json, report) else 1


def _write_json(flag: str, path: Path | None, report: BaseModel) -> bool:
    """Write ``report`` to ``path`` (checked before the run; None: nothing);
    False, said on stderr, when the write fails after all."""
    if path is None:
        return True
    try:
        path.write_text(report.model_dump_json(indent=2) + "\n")
    except OSError as e:
        print(f"ppsync: {flag} {path}: not written: {e.strerror or e}", file=sys.stderr)
        return False
    return True


SYNC_FLAGS = {"pp_size": "--pp-size", "max_num_reqs": "--max-num-reqs",
              "num_speculative_steps": "--spec", "ring_depth": "--ring-depth",
              "timeout_s": "--timeout", "silent_s": "--silent", "wire": "--wire",
              "codec": "--codec", "carrier": "--carrier",
              "device_kernels": "--device-kernels", "cpu_kernels": "--cpu-kernels",
              "flight_events": "--flight-events"}
"""SyncConfig's fields -> the flags that set them (what an error names)."""
BENCH_FLAGS = {"pp_size": "--pp-size", "rows": "--rows", "spec": "--spec",
               "iters": "--iters", "pipelined_iters": "--pipelined-iters",
               "compute_us": "--compute-us", "warmup": "--warmup", "hidden": "--hidden",
               "max_num_reqs": "--max-num-reqs", "timeout_s": "--timeout"}
"""BenchOptions' fields -> the flags that set them."""


@contextlib.contextmanager
def flags_named(flags: dict[str, str]) -> Iterator[None]:
    """A model's ConfigError (a rule across fields: the bounds of one are
    checked at parsing) in the command line's words: the flags, not the
    model and its fields (``--ring-depth = 3 exceeds --pp-size = 2``)."""
    try:
        yield
    except ConfigError as e:
        text = re.sub(r"^invalid \w+: ", "", str(e))
        for name, flag in sorted(flags.items(), key=lambda kv: -len(kv[0])):
            text = re.sub(rf"\b{name}\b", flag, text)
        raise ConfigError(text) from None


def _config(args: argparse.Namespace, pp_size: int) -> SyncConfig:
    with flags_named(SYNC_FLAGS):
        config = SyncConfig.build(
            pp_size=pp_size,
            max_num_reqs=args.max_num_reqs,
            num_speculative_steps=args.spec,
            ring_depth=args.ring_depth,
            timeout_s=args.timeout,
            silent_s=args.silent,
            wire=args.wire,
            codec=args.codec,
            carrier=args.carrier,
            device_kernels=args.device_kernels,
            cpu_kernels=args.cpu_kernels,
            flight_events=args.flight_events,
        )
    if args.emulate is not None:  # before any rank starts
        carried = StreamOrdered() if config.carrier == "device" else HostCompleted()
        check_frames(config, carried, f"gloo emulating {args.emulate}")
    # a kernel set named outright that cannot run here: a bad argument (exit 2)
    # before any rank starts ("auto" always resolves)
    if config.cpu_kernels != "auto":
        resolve_cpu_kernels(config)
    if frames_on_device(config.codec) and config.device_kernels != "auto":
        resolve_device_kernels(config, torch.device(getattr(args, "device", "cpu")))
    return config


def _dump_dir(args: argparse.Namespace) -> Path | None:
    """--dump-dir, else $PPSYNC_DUMP_DIR, else None (no dumps)."""
    if args.dump_dir is not None:
        return Path(args.dump_dir)
    env = os.environ.get(DUMP_DIR_ENV)
    return Path(env) if env else None


def _prepare_dumps(args: argparse.Namespace) -> Path | None:
    """The dump directory, checked before the run (ConfigError: exit 2), and
    what it held then, so that a failure names only the dumps of this run."""
    directory = _dump_dir(args)
    if directory is not None:
        check_dump_dir(directory, "--dump-dir" if args.dump_dir is not None else f"${DUMP_DIR_ENV}")
    args.dumps_before = dump_files(directory)
    return directory


def _point_at_dumps(args: argparse.Namespace) -> None:
    point_at_dumps(_dump_dir(args), vars(args).get("dumps_before"))


def _check_report_path(args: argparse.Namespace) -> None:
    """--report FILE must be writable before the run starts (a bad argument,
    exit 2), not found out once the run is done."""
    if args.report is not None:
        check_output_file("--report", args.report)


def _finish(args: argparse.Namespace, report: RunReport) -> int:
    print(format_table(report), flush=True)
    if report.ended is not None:
        stopped = report.ended.removeprefix("Stopped: ")
        print(f"ppsync: launch {stopped}" if stopped != report.ended
              else f"ppsync: {report.ended}", file=sys.stderr, flush=True)
    if not _write_json("--report", args.report, report):
        return 1
    if not report.ok:
        _point_at_dumps(args)
    return 0 if report.ok else 1


def _launch(args: argparse.Namespace) -> int:
    config = _config(args, args.pp_size)
    _check_report_path(args)
    _prepare_dumps(args)
    try:
        # a run that fails or is ended still reports what was checked (INCOMPLETE)
        report = run_local(config, steps=args.steps, seed=args.seed, framework=args.framework,
                           jitter_us=args.jitter_us, knobs={"max_arrivals": args.arrivals},
                           world_size=args.world_size,
                           progress_s=None if args.quiet else args.progress_every,
                           dump_dir=_dump_dir(args), emulate=args.emulate,
                           keep_partial=True, stacks=args.stacks)
    except ConfigError:
        raise
    except PPSyncError as e:  # the dumps' pointers are the last lines
        print(f"ppsync: {type(e).__name__}: {e}", file=sys.stderr)
        _point_at_dumps(args)
        return 1
    return _finish(args, report)


def _run(args: argparse.Namespace) -> int:
    # a stuck rank prints every thread's stack on SIGUSR1 (to stderr, fd 2) and,
    # with a dump directory, dumps its flight record (also on an error, at exit)
    install_dump_triggers(_prepare_dumps(args))
    signal.signal(signal.SIGTERM, _stopped)
    world = WorldEnv.from_environ(os.environ)
    if args.pp_size is None and world.world_size < 2:
        raise ConfigError(f"--pp-size defaults to WORLD_SIZE = {world.world_size}, which must "
                          f"be >= 2{PP_SIZE_ONE}")
    config = _config(args, args.pp_size or world.world_size)
    if world.rank == 0:
        _check_report_path(args)
    if args.check:
        pipeline_groups(world.world_size, config.pp_size)
        rank_device(args.device, config.codec, world.local_rank)
        print(f"ppsync: run --check: ok (world {world.world_size}, pp_size {config.pp_size}, "
              f"device {args.device})", file=sys.stderr)
        return 0
    opts = RunOptions(args.steps, args.seed, args.framework, args.jitter_us,
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
    # os._exit skips atexit; no-op without a dump directory
    dump_all("signal", error=Stopped(f"stopped by {signal.Signals(signum).name}", signum))
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
        if args.command == "sglang-check":
            return _sglang_check(args)
        if args.command in ("dump", "schema"):
            return int(args.run(args))
    except ConfigError as e:
        print(f"ppsync: {e}", file=sys.stderr)
        return 2
    except PPSyncError as e:
        print(f"ppsync: {_who(args)}{type(e).__name__}: {e}", file=sys.stderr)
        if args.command == "run":
            _point_at_dumps(args)
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


def run_command(args: argparse.Namespace) -> int:
    """Run the parsed command; its exit status."""
    code = _dispatch(args)
    if dist.is_initialized():
        # this process joined a gloo world (`run`): after a failed collective
        # gloo's threads can abort the interpreter's exit (rc 134), so leave now
        dump_all("exit")  # os._exit skips atexit; no-op without a dump directory
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code
