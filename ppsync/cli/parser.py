"""The ``ppsync`` command's arguments: the parser of every subcommand. A bad
value is refused at parsing, in one line naming the flag, exit 2; bounds
come from the models the flags set (ppsync.cli.flag_values). Parsing imports no
torch: ``ppsync --help`` answers at once."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn, get_args

from ppsync.cli.flag_values import Renamed, at_least, bounded, from_field
from ppsync.debug.cli import add_debug_commands
from ppsync.schemas.bench import BenchOptions
from ppsync.schemas.bounds import field_bounds
from ppsync.schemas.config import (
    DEFAULT_SILENT_S,
    DEFAULT_TIMEOUT_S,
    CarrierName,
    CodecName,
    CpuKernelsName,
    DeviceKernelsName,
    EmulatedName,
    SyncConfig,
    WireMode,
    frames_on_device,
)
from ppsync.schemas.dump import DUMP_DIR_ENV

SLOW_S = 90.0
"""vllm-check and sglang-check's slow-last: a stall well past silent_s, under
vLLM's own bound on a step (300 s)."""
IDLE_S = 180.0
"""vllm-check's idle: the engine's idle between its generate calls."""

DESCRIPTION = """\
ppsync carries each step's sampled tokens (with accepted counts and drafts)
from the last pipeline-parallel stage to every earlier one, over a dedicated
torch.distributed group, every frame checked and every wait bounded. This
command checks it: `launch` runs a synthetic engine workload over local gloo
ranks and checks every delivered row; `run` is one rank of the same check
under torchrun or any launcher that sets RANK, WORLD_SIZE, MASTER_ADDR and
MASTER_PORT; `bench` times it against raw broadcasts and vLLM's scheme;
`dump` reads the flight recorder's dumps; `vllm-check` runs vLLM with and
without it and compares the tokens."""

EXIT_CODES = """\
exit status of launch and run: 0 every row arrived exactly once and intact;
1 a row was lost, stale, duplicated or corrupt, a rank failed, or the run was
ended before its end (the table then says INCOMPLETE); 2 a bad argument or
environment. dump show: 0 OK, 1 FAILED, 3 INCOMPLETE, 4 STOPPED. bench: 0
(its targets are goals, never checked)."""

BENCH_HELP = """\
Time the token path on P local gloo ranks; print figures, never a pass/fail.

lockstep (every rank enters each variant at the same instant; the worst case):
  a_raw_frame     one raw broadcast of a frame's words (the floor)
  b_vllm          vLLM's scheme: tokens / counts / drafts in 2-3 broadcasts
  c_ppsync_sync   TokenPath, ring depth 1: publish; post then consume
  d_ppsync_async  the same through the anyio services (asyncio)
  span: first rank in to last rank out; last/recv: each role's own time
pipelined (an engine-like loop, --compute-us of compute per step, D in flight):
  vllm, ppsync_sync, ppsync_async: step time, time blocked in the token path,
  done@cons (share of steps whose transfer was complete at consume), loop lag
then: own CPU per step (lockstep, pipelined, and a hot loop of the real path,
against vLLM's host calls), the flight recorder's CPU per step (on and off),
dispatches per step, and the targets: goals set for P=2, 256 rows, K=0 or 3,
C=400 us, printed for that configuration only, never checked (exit 0)."""

DEVICES = ("cpu", "cuda", "xpu")
"""Where ``run``'s tensors may live: the CPU and the accelerators whose
platforms ppsync.core.wire.platform knows (a test compares the two)."""

DEMO_STEPS = 3000
"""Steps of ``launch`` and ``run`` when --steps is not given (``make demo``'s)."""

PP_SIZE_ONE = " (P = 1 has no receiver: nothing to check)"
"""Why ``launch`` and ``run`` refuse pp_size 1 (bench's own bound says it too)."""


class _Help(argparse.RawDescriptionHelpFormatter):
    """Every option's help ends with its default, unless it says one itself;
    descriptions and epilogs are printed as written."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if ("default" in text or not action.option_strings or action.required
                or action.default is False or action.default == argparse.SUPPRESS):
            return text
        return f"{text} (default: {'none' if action.default is None else '%(default)s'})"


class _Parser(argparse.ArgumentParser):
    """A parser whose subcommands' parsers show their defaults too, and whose
    error about one argument is one line naming it."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", _Help)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        if message.startswith("argument "):  # names the flag: one line is enough
            self.exit(2, f"{self.prog}: error: {message}\n")
        super().error(message)


SECONDS_MAX = field_bounds(SyncConfig, "timeout_s")[2] or 86400.0
"""The longest bound a flag takes: SyncConfig's timeout's."""

_at_least = at_least
_positive = at_least(1)
_non_negative = at_least(0)
_seconds = bounded(float, 0.0, SECONDS_MAX, low_in=False, unit=" seconds")
_jitter_us = bounded(float, 0.0, SECONDS_MAX * 1e6, unit=" µs")


def _sync(field: str, **kwargs: Any) -> Any:
    return from_field(SyncConfig, field, **kwargs)


_pp_size = _sync("pp_size", low=2, why=PP_SIZE_ONE)


CONFIG_DEFAULT = {name: field.default for name, field in SyncConfig.model_fields.items()}
"""SyncConfig's defaults: a flag that sets a field never restates its default."""


def _bench_opt(field: str) -> Any:
    return from_field(BenchOptions, field)


def _workload_flags(la: argparse.ArgumentParser) -> None:
    """The flags ``launch`` and ``run`` share (one place for new ones)."""
    la.add_argument("--steps", type=_positive, default=DEMO_STEPS,
                    help=f"engine steps (default {DEMO_STEPS}, the demo's; D more drain the ring)")
    la.add_argument("--spec", type=_sync("num_speculative_steps"), default=0, metavar="K",
                    help="speculative steps K (draft tokens per request per step)")
    la.add_argument("--max-num-reqs", type=_sync("max_num_reqs"), default=64,
                    help="request slots")
    la.add_argument("--ring-depth", type=_sync("ring_depth"), default=None, metavar="D",
                    help="steps between a receive's post and its consume (default pp_size)")
    la.add_argument("--seed", type=_non_negative, default=0, help="workload seed (>= 0)")
    la.add_argument("--wire", choices=get_args(WireMode), default=CONFIG_DEFAULT["wire"],
                    help="frame sizing")
    la.add_argument("--codec", choices=get_args(CodecName),
                    default=CONFIG_DEFAULT["codec"],
                    help="frame codec: host (numpy, the CPU default) or device (torch ops, "
                    "checks deferred one step; runs on CPU tensors here)")
    la.add_argument("--carrier", choices=get_args(CarrierName),
                    default=CONFIG_DEFAULT["carrier"],
                    help="how the device codec's frames travel: host (pinned host memory "
                    "over gloo: no kernel waits on a peer) or device (the device's backend "
                    "on a side stream, as vLLM's handler)")
    la.add_argument("--device-kernels", choices=get_args(DeviceKernelsName),
                    default=CONFIG_DEFAULT["device_kernels"],
                    help="the device codec's kernels: triton, torch (ops) or auto (Triton on "
                    "CUDA/XPU where it imports, else torch); only with --codec device")
    la.add_argument("--cpu-kernels", choices=get_args(CpuKernelsName),
                    default=CONFIG_DEFAULT["cpu_kernels"],
                    help="the host-side kernels (the batch facts, with either codec; the frames "
                    "too with --codec host): numba, numpy or auto (numba where it loads, "
                    "else numpy)")
    la.add_argument("--host-kernels", action=Renamed, new="--cpu-kernels")
    la.add_argument("--timeout", type=_sync("timeout_s"), default=DEFAULT_TIMEOUT_S,
                    help="bound on one wait for a live peer (s), from the wait's start; "
                    "launch ends a rank that completes no step for this long plus a grace")
    la.add_argument("--silent", type=_sync("silent_s"), default=DEFAULT_SILENT_S,
                    metavar="S", help="a peer whose heartbeat stops this long is named "
                    "silent (s), whatever the step time")
    la.add_argument("--async", dest="framework", nargs="?", const="asyncio", default=None,
                    choices=["asyncio", "trio"],
                    help="carry tokens through the anyio services (framework asyncio when "
                    "none is named)")
    la.add_argument("--arrivals", type=_positive, default=4,
                    help="most requests arriving in one step (load)")
    la.add_argument("--jitter-us", type=_jitter_us, default=0.0,
                    help="each rank pauses a random 0..N µs per step (slow, jittery ranks)")
    la.add_argument("--report", type=Path, default=None, help="write the run report as JSON")
    la.add_argument("--emulate", choices=get_args(EmulatedName), default=None,
                    help="token groups whose works behave as this backend's (the CPU twin of "
                         "stream-ordered backends; needs --codec device and --wire fixed)")
    la.add_argument("--join-timeout", type=_seconds, default=120.0, metavar="S",
                    help="bound on joining the world: ranks may start seconds apart")
    la.add_argument("--progress-every", type=_seconds, default=5.0, metavar="S",
                    help="rank 0 prints steps done, steps/s and ETA to stderr every S seconds")
    la.add_argument("--quiet", action="store_true", help="no progress line")
    la.add_argument("--flight-events", type=_sync("flight_events"), default=4096, metavar="N",
                    help="events each rank's flight recorder keeps (0 = off)")
    la.add_argument("--dump-dir", type=Path, default=None, metavar="DIR",
                    help="ranks dump their flight records here on an error, on SIGUSR1 and "
                    f"at exit (default ${DUMP_DIR_ENV}; unset: no dumps)")


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="ppsync", description=DESCRIPTION, epilog=EXIT_CODES)
    sub = p.add_subparsers(dest="command", required=True)
    la = sub.add_parser("launch", help="run the workload over P local gloo ranks",
                        description="Run the synthetic workload over local gloo ranks and "
                        "print one row per rank and a verdict line.", epilog=EXIT_CODES)
    la.add_argument("--pp-size", type=_pp_size, required=True, help="ranks P per PP group")
    la.add_argument("--world-size", type=_positive, default=None,
                    help="ranks in all (default pp_size; a multiple: tensor x pipeline)")
    la.add_argument("--stacks", action="store_true",
                    help="a rank ended as stuck prints every thread's stack first (to stderr)")
    _workload_flags(la)
    ru = sub.add_parser("run", help="one rank from torchrun's environment (RANK, WORLD_SIZE, "
                        "LOCAL_RANK, MASTER_ADDR, MASTER_PORT); rank 0 prints the table")
    ru.add_argument("--device", choices=DEVICES, default="cpu",
                    help="where each rank's tensors live: cuda / xpu use the accelerator at "
                    "LOCAL_RANK (modulo the visible count); token groups on gloo (the host "
                    "carrier) or, with --carrier device, nccl / xccl; needs --codec device")
    ru.add_argument("--pp-size", type=_pp_size, default=None,
                    help="ranks P per PP group (default WORLD_SIZE; a divisor of it: "
                    "tensor x pipeline)")
    ru.add_argument("--check", action="store_true",
                    help="check the flags and the environment (variables, layout, device, "
                    "--report) and exit 0, or 2 naming what is wrong, without joining")
    ru.add_argument("--run-id", default=None, metavar="ID",
                    help="name of this run in the store: every rank gives the same one "
                    "(default torchrun's TORCHELASTIC_RUN_ID; without either, each rank "
                    "counts its runs on the store); keys of other runs are never read")
    _workload_flags(ru)
    be = sub.add_parser("bench", help="time the token path against raw broadcasts and "
                        "vLLM's scheme on P local gloo ranks (lockstep and pipelined)",
                        description=BENCH_HELP)
    be.add_argument("--pp-size", type=_bench_opt("pp_size"), default=2, help="ranks P")
    be.add_argument("--rows", type=_bench_opt("rows"), default=256,
                    help="decode rows per step")
    be.add_argument("--spec", type=_bench_opt("spec"), default=0, metavar="K",
                    help="speculative steps K")
    be.add_argument("--iters", type=_bench_opt("iters"), default=None,
                    help="lockstep iterations (default 2000; 200 with --hidden)")
    be.add_argument("--pipelined-iters", type=_bench_opt("pipelined_iters"), default=None,
                    help="measured steps per pipelined scheme (default iters / 2)")
    be.add_argument("--compute-us", type=_bench_opt("compute_us"), default=400,
                    help="simulated compute per pipelined step, µs")
    be.add_argument("--warmup", type=_bench_opt("warmup"), default=100,
                    help="warm-up iterations")
    be.add_argument("--hidden", type=_bench_shape, default=None, metavar="ROWSxHIDDEN",
                    help="concurrent [ROWS, HIDDEN] float32 send/recv between stages on the "
                    "world group; token traffic runs on the dedicated group and on the world group")
    be.add_argument("--max-num-reqs", type=_bench_opt("max_num_reqs"), default=None,
                    help="request slots, the fixed frame's rows (default: rows)")
    be.add_argument("--timeout", type=_bench_opt("timeout_s"), default=DEFAULT_TIMEOUT_S,
                    help="bound on every wait (s)")
    be.add_argument("--json", type=Path, default=None, metavar="FILE",
                    help="write every figure as JSON")
    vc = sub.add_parser("vllm-check", help="run the installed vLLM twice at "
                        "pipeline_parallel_size 2 (or --pp-size), optionally with speculative "
                        "decoding (--spec K), on a small dummy model, with vLLM's own "
                        "PPHandler and with ppsync's plugin: the handler each worker built, "
                        "whether the tokens are identical, the time per generate and receive "
                        "(0 pass, 1 fail, 2 no vLLM here: `make vllm-check`)")
    vc.add_argument("--pp-size", type=_at_least(2), default=2,
                    help="pipeline stages (3 and up: middle ranks)")
    vc.add_argument("--spec", type=_non_negative, default=0, metavar="K",
                    help="speculative decoding with K draft tokens per step in both runs, on "
                    "prompts with repeating patterns; the check then also needs drafts "
                    "accepted (0: none)")
    vc.add_argument("--spec-method", default="ngram_gpu", metavar="M",
                    help="vLLM's speculative method with --spec (ngram_gpu: a model-free "
                    "proposer that runs with async scheduling)")
    vc.add_argument("--prompts", type=_positive, default=4, help="prompts")
    vc.add_argument("--max-tokens", type=_positive, default=None,
                    help="new tokens per prompt (none: 12; 32 with --spec)")
    vc.add_argument("--calls", type=_positive, default=None,
                    help="generate calls per run, each on every prompt (none: 2; 1 with "
                    "--fault; 3 with --repeat)")
    vc.add_argument("--repeat", type=_positive, default=1, metavar="N",
                    help="timing: N runs per handler, alternating (vLLM's first), each run's "
                    "generate times and median time per output token after the first call, "
                    "and the ratio ppsync / vLLM with its min-max")
    vc.add_argument("--codec", choices=get_args(CodecName), default=None,
                    help="ppsync's codec in its run (PPSYNC_CODEC; none: the device's default, "
                    "device with --emulate)")
    vc.add_argument("--carrier", choices=get_args(CarrierName), default=None,
                    help="how ppsync's device frames travel in its run (PPSYNC_CARRIER; none: "
                    "host)")
    vc.add_argument("--cpu-kernels", choices=get_args(CpuKernelsName), default=None,
                    help="ppsync's CPU kernels in its run (PPSYNC_CPU_KERNELS)")
    vc.add_argument("--host-kernels", action=Renamed, new="--cpu-kernels")
    vc.add_argument("--device-kernels", choices=get_args(DeviceKernelsName), default=None,
                    help="ppsync's device kernels in its run (PPSYNC_DEVICE_KERNELS)")
    vc.add_argument("--emulate", choices=get_args(EmulatedName), default=None,
                    help="ppsync's token groups behave as NCCL's or XCCL's: the CPU twin "
                    "(PPSYNC_EMULATE; CPU only); the report shows each worker's twin counts")
    vc.add_argument("--handler-timeout", type=_seconds, default=None, metavar="S",
                    help="ppsync's bound on one wait for a live peer in its run "
                    f"(PPSYNC_TIMEOUT_S; none: the handler's default, {DEFAULT_TIMEOUT_S:g}; 20 "
                    "with --mismatch)")
    vc.add_argument("--handler-silent", type=_seconds, default=None, metavar="S",
                    help="how long a peer's heartbeat may stop before ppsync's run names it "
                    f"silent (PPSYNC_SILENT_S; none: the handler's default, {DEFAULT_SILENT_S:g})")
    vc.add_argument("--fault", choices=["kill-last", "stop-last", "kill-first", "slow-last",
                                        "idle", "kill-node", "stop-node", "cut-link"],
                    default=None,
                    help="one PP worker SIGKILLs (kill-) or SIGSTOPs (stop-) itself while the "
                    "engine generates, with each handler: how each engine ended; the healthy "
                    "twins, which must pass with identical tokens and no error: the last "
                    "worker sleeps in one step (slow-last, --slow), the engine idles between "
                    "its generate calls (idle, --idle); with --nodes 2, while the HTTP client "
                    "streams: every process of host 1 SIGKILLed (kill-node) or SIGSTOPped "
                    "(stop-node), or its veth taken down (cut-link)")
    vc.add_argument("--slow", type=_seconds, default=None, metavar="S",
                    help="with --fault slow-last: the last worker's sleep in one step "
                    f"(none: {SLOW_S:g})")
    vc.add_argument("--idle", type=_seconds, default=None, metavar="S",
                    help="with --fault idle: the engine's idle between its generate calls "
                    f"(none: {IDLE_S:g})")
    vc.add_argument("--nodes", type=int, choices=[1, 2], default=1,
                    help="2: two hosts (network namespaces joined by a veth pair; root), "
                    "vLLM's multi-node launch (head with the API server, the other "
                    "--headless), pp-size / 2 stages per host, served over HTTP with "
                    "concurrent, streamed and cancelled requests")
    vc.add_argument("--mismatch", choices=["switch", "codec", "timeout"], default=None,
                    help="with --nodes 2, ppsync's run only: host 1 without PPSYNC_VLLM=1 "
                    "(switch), or with another PPSYNC_CODEC or PPSYNC_TIMEOUT_S than host 0: "
                    "every ppsync worker must refuse in one line naming the other rank")
    vc.add_argument("--requests", type=_positive, default=12,
                    help="with --nodes 2: requests in the HTTP burst")
    vc.add_argument("--fault-after", type=_positive, default=4, metavar="N",
                    help="the faulted worker's step of its fault (slow-last: its model step)")
    vc.add_argument("--fault-bound", type=_seconds, default=120.0, metavar="S",
                    help="how long after the fault a run is watched before it is called hung")
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
    sc = sub.add_parser("sglang-check", help="run the installed SGLang engine at pp_size 2 on a "
                        "tiny dummy Llama without and with ppsync's guard, side by side: tokens, "
                        "the guard on every stage, a desync case, and with --fault a killed or "
                        "stopped last stage (0 pass, 1 fail, 2 no SGLang here: "
                        "`make sglang-check`)")
    sc.add_argument("--fault", action="append", default=None,
                    choices=("none", "kill-last", "stop-last", "slow-last", "desync"),
                    metavar="CASE",
                    help="a case to run: none (tokens and the guard), kill-last, stop-last "
                    "(SIGKILL / SIGSTOP the last stage's scheduler after a first generate), "
                    "slow-last (the last stage sleeps --slow s in one step: a healthy slow "
                    "stage, never a fault), desync (a stage's view perturbed); repeat for more "
                    "(default: none and desync)")
    sc.add_argument("--timeout", type=_seconds, default=None, metavar="S",
                    help="the guard's PPSYNC_TIMEOUT_S in the guarded runs (none: unset, "
                    f"ppsync's default, {DEFAULT_TIMEOUT_S:g})")
    sc.add_argument("--silent", type=_seconds, default=None, metavar="S",
                    help="the guard's PPSYNC_SILENT_S in the guarded runs (none: unset, "
                    f"ppsync's default, {DEFAULT_SILENT_S:g})")
    sc.add_argument("--slow", type=_seconds, default=SLOW_S, metavar="S",
                    help="slow-last: the last stage's sleep in one step")
    sc.add_argument("--hang", type=_seconds, default=60.0, metavar="S",
                    help="how long SGLang alone may go on after a fault before it is "
                    "reported still hung")
    sc.add_argument("--max-tokens", type=_positive, default=8, help="new tokens per prompt")
    sc.add_argument("--work-dir", type=Path, default=Path("sglang-check-work"), metavar="DIR",
                    help="where the model config, the engines' logs and the dumps go")
    add_debug_commands(sub)
    return p


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The parsed command line; a bad value or a combination of flags that
    does not go together: one line naming the flag, exit 2."""
    parser = _parser()
    args = parser.parse_args(argv)
    if (args.command in ("launch", "run") and not frames_on_device(args.codec)
            and args.device_kernels != "auto"):
        _sub(parser, args.command).error(
            f"argument --device-kernels: {args.device_kernels} is a kernel set of the "
            f"device codec; --codec {args.codec} does not use it (add --codec device)")
    return args


def _sub(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            child: argparse.ArgumentParser = action.choices[name]
            return child
    return parser


def _bench_shape(text: str) -> tuple[int, int]:
    parts = text.lower().split("x")
    if len(parts) != 2 or not all(x.strip().isdigit() and int(x) > 0 for x in parts):
        raise argparse.ArgumentTypeError(f"{text!r} must be ROWSxHIDDEN, e.g. 1024x4096")
    return int(parts[0]), int(parts[1])
