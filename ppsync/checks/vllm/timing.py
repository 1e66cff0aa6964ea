"""``ppsync vllm-check --repeat N``: timing to trust. The two handlers run
alternately, vLLM's first (ABAB...), N runs each; per run the time of each
``generate`` call and the median time per output token over the calls after
the first (the first carries warm-up: Triton's interpreter, caches); per
pair the ratio ppsync / vLLM of those medians, and their median with its
min-max. Every run's tokens must equal the first run's.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from pathlib import Path

from ppsync.checks.vllm.report import (
    RunResult,
    handler_failures,
    path_line,
    token_differences,
)
from ppsync.checks.vllm.runs import run_engine

__all__ = ["format_timing", "per_token_s", "run_timing", "timing_failures"]


def per_token_s(run: RunResult) -> float | None:
    """Median seconds per output token over the generate calls after the
    first (None: fewer than two calls, or no tokens)."""
    per_call = [sum(len(t) for t in call) for call in run.tokens]
    values = [s / n for s, n in zip(run.generate_s[1:], per_call[1:], strict=False) if n]
    return statistics.median(values) if values else None


def timing_failures(runs: Sequence[RunResult], pp_size: int) -> list[str]:
    """Why the repeated runs fail: one did not finish or built the wrong
    handler, or its tokens differ from the first run's."""
    out = []
    for i, run in enumerate(runs):
        if run.error is not None:
            out.append(f"run {i + 1} ({run.label}): did not finish: {run.error}")
            continue
        out += [f"run {i + 1}: {w}" for w in handler_failures(run, pp_size)]
        if i:
            out += [f"run {i + 1} ({run.label}): tokens differ from run 1's: {d}"
                    for d in token_differences(runs[0], run)]
    return out


def format_timing(runs: Sequence[RunResult], pp_size: int) -> str:
    lines = ["", "timing, per run (generate calls; median time per output token after the "
             "first call):"]
    for i, run in enumerate(runs):
        tpt = per_token_s(run)
        gen = ", ".join(f"{s:.2f} s" for s in run.generate_s) or "-"
        lines.append(f"  run {i + 1} {run.label}: generate {gen}; "
                     f"{'-' if tpt is None else f'{tpt * 1e3:.1f} ms'} per token")
    ran = {path_line(w) for run in runs for w in run.workers if w.path}
    lines += [f"  ppsync ran: {r}" for r in sorted(ran)]
    ratios = []
    for a, b in zip(runs[0::2], runs[1::2], strict=False):
        ta, tb = per_token_s(a), per_token_s(b)
        if ta and tb:
            ratios.append(tb / ta)
    if ratios:
        lines.append(f"  ratio ppsync / vLLM per pair: {', '.join(f'{r:.3f}' for r in ratios)}; "
                     f"median {statistics.median(ratios):.3f} (min {min(ratios):.3f}, max "
                     f"{max(ratios):.3f})")
    why = timing_failures(runs, pp_size)
    lines.append("")
    lines += ["FAIL", *(f"  {w}" for w in why)] if why else [
        f"PASS: {len(runs)} runs finished with identical tokens, each with the handler it "
        "asked for (the ratio is reported, not judged)"]
    return "\n".join(lines)


def run_timing(repeat: int, pp_size: int, work: Path, env: dict[str, str],
               spec_file: Path, timeout_s: float) -> int:
    """The ABAB runs and their report; exit 1 on a failure (tokens, handler, a run)."""
    runs: list[RunResult] = []
    for _ in range(repeat):
        for label, ppsync in (("vLLM's PPHandler", False), ("ppsync's plugin", True)):
            n = len(runs) + 1
            print(f"  run {n} of {2 * repeat} ({label}) ...", flush=True)
            runs.append(run_engine(label, ppsync, work, f"run-{n}-{'ppsync' if ppsync else 'vllm'}",
                                   env, spec_file, timeout_s))
    print(format_timing(runs, pp_size), flush=True)
    return 1 if timing_failures(runs, pp_size) else 0
