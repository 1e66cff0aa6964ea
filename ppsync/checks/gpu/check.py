"""``make gpu-check``: the device path on a GPU machine, as one command.

    python3 -m ppsync.checks.gpu.check [--steps N] [--budget S]

It runs with the interpreter it is started with (a CUDA image's python3:
no venv, no network; ppsync's own needs carried as wheels: docs/operations.md,
"GPU check"). Each check runs in a fresh process of its own, bounded (60-90
s; a worker that overruns is terminated, then killed: ppsync.harness.fresh),
and its row is printed and flushed as soon as it ends. The whole run stays
within ``--budget`` seconds (default 330): a check gets at most what is
left, and one that cannot start in time reads SKIP. Its wall time is printed.

Which carrier a row's token path runs (SyncConfig.carrier): over an NCCL
token group always "device" (NCCL takes device tensors only); over gloo the
default, "host" (pinned memory). f, k, l and m build no token path.

a) two ranks sharing GPU 0 over gloo, CUDA tensors, the device codec, the
   host carrier: the workload, exact delivery, ppsync's calls under sync
   debug mode.
b) a one-rank NCCL token group (device carrier): a step, then a deferred
   BatchError.
c) >= 2 GPUs: P = min(4, GPUs) ranks over NCCL (device carrier), exact,
   then timed.
d) a late peer: post() and the main stream's work are not held (NCCL and
   the device carrier with >= 2 GPUs; else gloo and the host carrier).
e) per step, per role: host / device µs of vLLM's scheme and the device
   codec with each carrier; no host sync in ppsync's calls (the guard
   shown live first).
   (a-e: ppsync.checks.gpu.workload_checks)
f) a one-rank NCCL broadcast behind a long kernel: future done, work not
   completed (asserted: the premise of stream-ordered completion).
g) the engine overwrites its sampler outputs right after publish (gloo:
   host carrier; NCCL with >= 2 GPUs: device carrier).
h) Triton's compiled variants stay flat across row counts.
i) >= 2 GPUs: kill -9 of the last rank (NCCL, device carrier); every
   survivor names it.
   (f-i: ppsync.checks.gpu.stream_checks)
j) ``Work.exception()`` on this torch; ppsync's completion never calls it
   (its path steps: device carrier).
k) the abort of a pending one-rank broadcast: what NCCL says, how long it
   took, and that ppsync counts the work failed with the abort's cause.
l) ``is_completed()`` µs per call.
   (j-l: ppsync.checks.gpu.failure_checks)
m) a CUDA graph captured while ppsync's deadline guard polls a pending
   work (and, reported only, the services' loop from another thread)
   (ppsync.checks.gpu.capture_check).
n) P = 2 and 3 ranks on GPU 0 over gloo, the host carrier: the workload
   at K = 0 and 3, exact; no copy waited on, no pinned buffer reused
   early; every token-path call under sync debug "error".
o) the host carrier: a torch.profiler trace of each rank's steps holds no
   NCCL kernel (the kernels seen counted).
p) the host carrier: a matmul loop with the token path's calls within
   1.02x of the same loop without them, on every rank (P = 2 and 3).
   (n-p: ppsync.checks.gpu.carrier_checks)

The summary's carrier line says what the run's n, o and p show of the host
carrier as the default, and what a GPU run would have to show to change it.

Exit status: 0 every check that ran passed, 1 one failed, 2 nothing run
(no CUDA device, said on stderr: a check that ran nothing must not read as
a pass). ``make gpu-check`` wraps it in ``timeout 360``.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import TextIO

import torch

from ppsync.checks.gpu import capture_check as capture
from ppsync.checks.gpu import carrier_checks as carrier
from ppsync.checks.gpu import failure_checks as failure
from ppsync.checks.gpu import stream_checks as stream
from ppsync.checks.gpu import workload_checks as workload
from ppsync.core.codec.device_kernels import triton_error
from ppsync.harness.fresh import Overran, in_fresh_process

RUN_BUDGET_S = 330.0
"""The whole run's bound (checks not started in it read SKIP)."""
MIN_BOUND_S = 15.0
"""A check is not started with less than this (or its own bound) left of the budget."""
NAME_WIDTH = 58
ONE_GPU_GAPS = (
    "not checkable on one GPU, the CPU twin (--emulate nccl|xccl) stands in: an abort across "
    "ranks (tests/faults/test_fault_abort_release.py, tests/faults/test_fault_exit.py), "
    "NCCL's watchdog (tests/faults/test_fault_watchdog.py), a pending cross-rank receive "
    "(tests/faults/test_fault_peer_death.py, tests/core/wire/completion/test_twin.py)")


@dataclass(frozen=True)
class Check:
    """One row: ``run`` (picklable; returns (passed, detail), may raise
    CheckSkipped) runs in a fresh process bounded at ``bound_s``; a
    non-empty ``skip`` says why it is not run at all."""

    name: str
    run: Callable[[], tuple[bool, str]]
    bound_s: float
    skip: str = ""


Row = tuple[str, str, str, float]
"""(name, PASS | FAIL | SKIP, detail, seconds)."""


def run_check(check: Check, left_s: float) -> Row:
    """``check`` in a fresh process, bounded by its bound and ``left_s``."""
    if check.skip:
        return check.name, "SKIP", check.skip, 0.0
    bound = min(check.bound_s, left_s)
    if left_s < min(MIN_BOUND_S, check.bound_s):
        return check.name, "SKIP", f"not started: {left_s:.0f} s left of the run's budget", 0.0
    t0 = time.perf_counter()
    try:
        ok, detail = in_fresh_process(check.run, timeout_s=bound)
        status = "PASS" if ok else "FAIL"
    except stream.CheckSkipped as e:
        status, detail = "SKIP", str(e)
    except Overran as e:
        status, detail = "FAIL", f"hung: {e} (its threads' stacks are on stderr)"
    except Exception as e:  # a check that raised failed; the others still run
        status, detail = "FAIL", f"{type(e).__name__}: {e}"[:400]
        print(f"{check.name}: ", end="", file=sys.stderr)
        traceback.print_exception(e, file=sys.stderr)  # with the worker's traceback
    return check.name, status, detail, time.perf_counter() - t0


def print_row(row: Row, out: TextIO) -> None:
    name, status, detail, secs = row
    print(f"{name:<{NAME_WIDTH}}  {status:<6}  {secs:5.1f}  {detail}", file=out, flush=True)


def run_table(checks: list[Check], budget_s: float, out: TextIO) -> list[Row]:
    """Every check in turn, each row printed and flushed as it ends."""
    print(f"{'check':<{NAME_WIDTH}}  result  {'s':>5}  detail", file=out, flush=True)
    deadline = time.monotonic() + budget_s
    rows = []
    for check in checks:
        row = run_check(check, deadline - time.monotonic())
        print_row(row, out)
        rows.append(row)
    return rows


def checks(steps: int, gpus: int, carrier_steps: int = carrier.STEPS) -> list[Check]:
    """The table's checks on a machine with ``gpus`` GPUs (``steps``: a's
    and c's workload steps; ``carrier_steps``: n's, per configuration)."""
    multi = "" if gpus >= 2 else f"{gpus} GPU: needs >= 2"
    triton = triton_error()
    p = functools.partial
    return [
        Check("a) 2 ranks on GPU 0, gloo, host carrier", p(workload.check_a, steps), 90),
        Check("b) 1-rank NCCL token group, device carrier", workload.check_b, 60),
        Check(f"c) P=min(4, {gpus}) ranks over NCCL, device carrier",
              p(workload.check_c, steps, gpus), 90,
              skip=multi),
        Check("d) late peer: post() and main stream not held", p(workload.check_d, gpus), 75),
        Check("e) per step: vLLM's scheme vs both carriers, no host sync",
              workload.check_e, 90),
        Check("f) 1-rank NCCL: future done, work not completed", stream.check_f, 60),
        Check("g) overwrite after publish, receivers get originals",
              p(stream.check_g, gpus), 75),
        Check("h) Triton variants flat across row counts", stream.check_h, 90,
              skip="" if triton is None else f"Triton cannot be loaded ({triton})"),
        Check("i) kill -9 of the last rank over NCCL, device carrier", p(stream.check_i, gpus),
              60, skip=multi),
        Check("j) 1-rank NCCL: Work.exception(), ppsync's completion", failure.check_j, 60),
        Check("k) 1-rank NCCL: abort of a pending broadcast", failure.check_k, 60),
        Check("l) 1-rank NCCL: is_completed() µs per call", failure.check_l, 60),
        Check("m) CUDA graph captured while a pending work is polled", capture.check_m, 60),
        Check("n) P=2, 3 on GPU 0, host carrier: exact, no wait, no sync",
              p(carrier.check_n, carrier_steps), 75),
        Check("o) host carrier: no NCCL kernel in each rank's profile", carrier.check_o, 60),
        Check(f"p) host carrier: matmul loop within {carrier.RATIO_LIMIT:.2f}x without it",
              carrier.check_p, 75),
    ]


def summary(rows: list[Row], wall_s: float, budget_s: float, gpus: int) -> list[str]:
    """The lines after the table: counts and wall time, the machine, what
    the run says of the default carrier, and what a one-GPU run leaves to
    the CPU twin."""
    count = {s: sum(1 for r in rows if r[1] == s) for s in ("PASS", "FAIL", "SKIP")}
    lines = [f"gpu-check: {count['PASS']} passed, {count['FAIL']} failed, {count['SKIP']} "
             f"skipped; wall time {wall_s:.1f} s (budget {budget_s:.0f} s)"]
    if gpus:
        lines.append(f"torch {torch.__version__}, {gpus} x {torch.cuda.get_device_name(0)}, "
                     f"Python {sys.version.split()[0]}")
    lines.append(carrier.carrier_line(rows))
    if gpus < 2:
        lines.append(ONE_GPU_GAPS)
    return lines


def main(argv: list[str] | None = None) -> int:
    t0 = time.perf_counter()
    ap = argparse.ArgumentParser(prog="python3 -m ppsync.checks.gpu.check",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=1000, help="workload steps in a and c")
    ap.add_argument("--carrier-steps", type=int, default=carrier.STEPS,
                    help="workload steps per configuration in n")
    ap.add_argument("--budget", type=float, default=RUN_BUDGET_S,
                    help="the whole run's bound in seconds")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print(f"gpu-check: not run: no CUDA device (torch {torch.__version__}, "
              "torch.cuda.is_available() is False). It needs one GPU, two or more for "
              "checks c and i, and a CUDA build of torch in this Python "
              f"({sys.executable}).", file=sys.stderr)
        return 2
    gpus = torch.cuda.device_count()
    rows = run_table(checks(args.steps, gpus, args.carrier_steps),
                     args.budget - (time.perf_counter() - t0),
                     sys.stdout)
    for line in summary(rows, time.perf_counter() - t0, args.budget, gpus):
        print(line, flush=True)
    return 1 if any(r[1] == "FAIL" for r in rows) else 0


if __name__ == "__main__":
    # through the package name, so fresh processes unpickle the checks by it
    from ppsync.checks.gpu import check as gpu_check

    sys.exit(gpu_check.main())
