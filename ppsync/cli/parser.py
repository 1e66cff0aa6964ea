"""The ``ppsync`` command's arguments: the parser of every subcommand, and
the value parsers that refuse a bad value at parsing (one line, exit 2)."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any, get_args

from ppsync.core.completion import EMULATED
from ppsync.debug.cli import add_debug_commands
from ppsync.schemas.config import (
    DEFAULT_TIMEOUT_S,
    DeviceKernelsName,
    HostKernelsName,
)
from ppsync.schemas.dump import DUMP_DIR_ENV


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


SECONDS_MAX = 86400.0
"""The longest bound a flag takes (a day), as SyncConfig's timeout."""


def _number(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(v):
        raise argparse.ArgumentTypeError(f"{text!r} must be a finite number")
    return v


def _seconds(text: str) -> float:
    v = _number(text)
    if not 0 < v <= SECONDS_MAX:
        raise argparse.ArgumentTypeError(f"{v} must be in (0, {SECONDS_MAX:.0f}] seconds")
    return v


def _jitter_us(text: str) -> float:
    v = _number(text)
    if not 0 <= v <= SECONDS_MAX * 1e6:
        raise argparse.ArgumentTypeError(f"{v} must be in [0, {SECONDS_MAX * 1e6:.0f}] µs")
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
    la.add_argument("--timeout", type=_seconds, default=DEFAULT_TIMEOUT_S,
                    help="bound on every wait (s)")
    la.add_argument("--async", dest="backend", nargs="?", const="asyncio", default=None,
                    choices=["asyncio", "trio"],
                    help="carry tokens through the anyio services (backend asyncio when "
                    "none is named)")
    la.add_argument("--arrivals", type=_positive, default=4,
                    help="most requests arriving in one step (load)")
    la.add_argument("--jitter-us", type=_jitter_us, default=0.0,
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
    ru.add_argument("--check", action="store_true",
                    help="check the flags and the environment (variables, layout, device, "
                    "--report) and exit 0, or 2 naming what is wrong, without joining")
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
    be.add_argument("--timeout", type=_seconds, default=DEFAULT_TIMEOUT_S,
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
    vc.add_argument("--codec", choices=["host", "device"], default=None,
                    help="ppsync's codec in its run (PPSYNC_CODEC; none: the device's default, "
                    "device with --emulate)")
    vc.add_argument("--host-kernels", choices=["auto", "numba", "numpy"], default=None,
                    help="ppsync's host kernels in its run (PPSYNC_HOST_KERNELS)")
    vc.add_argument("--device-kernels", choices=["auto", "triton", "torch"], default=None,
                    help="ppsync's device kernels in its run (PPSYNC_DEVICE_KERNELS)")
    vc.add_argument("--emulate", choices=list(EMULATED), default=None,
                    help="ppsync's token groups behave as NCCL's or XCCL's: the CPU twin "
                    "(PPSYNC_EMULATE; CPU only); the report shows each worker's twin counts")
    vc.add_argument("--handler-timeout", type=_seconds, default=None, metavar="S",
                    help="ppsync's bound on every wait in its run (PPSYNC_TIMEOUT_S; none: "
                    "60; 10 with --fault)")
    vc.add_argument("--fault", choices=["kill-last", "stop-last", "kill-first"], default=None,
                    help="one PP worker SIGKILLs (kill-) or SIGSTOPs (stop-) itself while the "
                    "engine generates, with each handler: how each engine ended")
    vc.add_argument("--fault-after", type=_positive, default=4, metavar="N",
                    help="the faulted worker's step of its fault")
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
    add_debug_commands(sub)
    return p


def _bench_shape(text: str) -> tuple[int, int]:
    parts = text.lower().split("x")
    if len(parts) != 2 or not all(x.strip().isdigit() and int(x) > 0 for x in parts):
        raise argparse.ArgumentTypeError(f"{text!r} must be ROWSxHIDDEN, e.g. 1024x4096")
    return int(parts[0]), int(parts[1])
