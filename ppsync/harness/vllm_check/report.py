"""What ``ppsync vllm-check`` found, compared and printed: no vLLM here.

A run is one vLLM engine at pipeline_parallel_size P: the handler class each
of its P workers built (read from the records the check's worker hooks
write, ppsync.harness.vllm_check.worker_hooks), the tokens of every
``generate`` call (``[call][prompt] -> token ids``), and the durations of
each ``generate`` and of each handler ``receive`` / ``broadcast`` /
``get_prev_sampled_outputs`` call. The
check passes when the run with vLLM's own handler built vLLM's in every
worker, the run with ppsync's plugin built ppsync's in every worker, both
ran to the end, and their tokens are identical.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["RunResult", "WorkerRecord", "failures", "format_report", "read_worker_records",
           "token_differences"]


@dataclass(frozen=True)
class WorkerRecord:
    """One worker process of a run, as its hook recorded it."""

    pid: int
    pp_rank: int
    pp_size: int
    runner: str
    handler: str | None  # module.qualname of the handler class it built; None: none built
    ppsync: bool  # the class is a subclass of ppsync.compat.vllm.handler.PPHandler
    receive_s: tuple[float, ...] = ()  # each receive call, seconds
    prev_s: tuple[float, ...] = ()  # each get_prev_sampled_outputs call, seconds
    broadcast_s: tuple[float, ...] = ()  # each broadcast call, seconds
    receive_all_rows: int = 0  # receive calls that returned True (every row needs a sample)
    receive_rows: tuple[int, ...] = ()  # each receive call's batch rows (num_reqs)


@dataclass(frozen=True)
class RunResult:
    """One vLLM engine run of the check."""

    label: str
    expect_ppsync: bool  # which handler every worker must have built
    workers: tuple[WorkerRecord, ...] = ()
    tokens: tuple[tuple[tuple[int, ...], ...], ...] = ()  # [call][prompt] token ids
    generate_s: tuple[float, ...] = ()  # each generate call, seconds
    error: str | None = None  # why the run did not finish
    log: str | None = None  # where vLLM's own output went
    notes: tuple[str, ...] = field(default=())


def read_worker_records(record_dir: Path) -> tuple[WorkerRecord, ...]:
    """The records the worker hooks wrote under ``record_dir``, by PP rank
    (a line cut short by a killed worker is skipped)."""
    workers = []
    for path in sorted(record_dir.glob("worker-*.jsonl")):
        head: dict[str, object] | None = None
        calls: dict[str, list[float]] = {"receive": [], "broadcast": [],
                                         "get_prev_sampled_outputs": []}
        all_rows = 0
        rows: list[int] = []
        for line in path.read_text().splitlines():
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                continue
            if event.get("event") == "handler":
                head = event
            elif event.get("event") in calls:
                calls[event["event"]].append(float(event["s"]))
                all_rows += event.get("returned") is True
                if event["event"] == "receive" and isinstance(event.get("rows"), int):
                    rows.append(event["rows"])
        if head is None:
            continue
        handler = head.get("handler")
        workers.append(WorkerRecord(
            pid=int(str(head["pid"])), pp_rank=int(str(head["pp_rank"])),
            pp_size=int(str(head["pp_size"])), runner=str(head.get("runner", "?")),
            handler=None if handler is None else str(handler), ppsync=bool(head.get("ppsync")),
            receive_s=tuple(calls["receive"]), broadcast_s=tuple(calls["broadcast"]),
            prev_s=tuple(calls["get_prev_sampled_outputs"]), receive_all_rows=all_rows,
            receive_rows=tuple(rows)))
    return tuple(sorted(workers, key=lambda w: (w.pp_rank, w.pid)))


def token_differences(a: RunResult, b: RunResult, limit: int = 5) -> list[str]:
    """Where the two runs' tokens differ (at most ``limit`` lines; empty: identical)."""
    out: list[str] = []
    if len(a.tokens) != len(b.tokens):
        return [f"{a.label} made {len(a.tokens)} generate calls, {b.label} {len(b.tokens)}"]
    for call, (pa, pb) in enumerate(zip(a.tokens, b.tokens, strict=True)):
        if len(pa) != len(pb):
            out.append(f"call {call}: {len(pa)} prompts against {len(pb)}")
            continue
        for prompt, (ta, tb) in enumerate(zip(pa, pb, strict=True)):
            if ta == tb:
                continue
            at = next((i for i, (x, y) in enumerate(zip(ta, tb, strict=False)) if x != y),
                      min(len(ta), len(tb)))
            out.append(f"call {call} prompt {prompt}: first difference at token {at} "
                       f"({list(ta[at:at + 4])} against {list(tb[at:at + 4])}; "
                       f"{len(ta)} and {len(tb)} tokens)")
    return out[:limit] + ([f"... {len(out) - limit} more"] if len(out) > limit else [])


def _handler_failures(run: RunResult, pp_size: int) -> list[str]:
    out = []
    want = "ppsync's" if run.expect_ppsync else "vLLM's own"
    ranks = sorted({w.pp_rank for w in run.workers})
    if ranks != list(range(pp_size)):
        out.append(f"{run.label}: handler records from PP ranks {ranks}, expected 0..{pp_size - 1} "
                   "(a worker that built no model runner, or whose hook did not load)")
    for w in run.workers:
        if w.ppsync != run.expect_ppsync or w.handler is None:
            out.append(f"{run.label}: worker pid {w.pid} (PP rank {w.pp_rank}) built "
                       f"{w.handler or 'no handler'}, not {want} PPHandler")
    return out


def failures(base: RunResult, ours: RunResult, pp_size: int) -> list[str]:
    """Why the check fails; empty when it passes."""
    out = []
    for run in (base, ours):
        if run.error is not None:
            out.append(f"{run.label}: did not finish: {run.error}")
    for run in (base, ours):
        out += _handler_failures(run, pp_size)
    if base.error is None and ours.error is None:
        diffs = token_differences(base, ours)
        out += [f"tokens differ: {d}" for d in diffs]
    return out


def _ms(values: Sequence[float]) -> str:
    if not values:
        return "-"
    ms = [v * 1e3 for v in values]
    return (f"{len(ms)} calls: mean {statistics.fmean(ms):.3f} ms, median "
            f"{statistics.median(ms):.3f} ms, max {max(ms):.3f} ms")


def _counts(values: Sequence[int]) -> str:
    """``{4: 20, 2: 6}`` as ``4 x20, 2 x6`` (most rows first)."""
    return ", ".join(f"{v} x{values.count(v)}" for v in sorted(set(values), reverse=True))


def format_report(base: RunResult, ours: RunResult, pp_size: int,
                  header: Sequence[str] = ()) -> str:
    """The check's printed report: header lines, the handler each worker
    built, the token comparison, the timings and the verdict."""
    lines = list(header)
    lines.append("")
    lines.append("handler built in each worker:")
    for run in (base, ours):
        if not run.workers:
            lines.append(f"  {run.label}: no worker recorded a handler")
        for w in run.workers:
            mark = "ppsync" if w.ppsync else "vLLM"
            lines.append(f"  {run.label}: PP rank {w.pp_rank}/{w.pp_size} (pid {w.pid}, "
                         f"{w.runner}): {w.handler or 'none'} [{mark}]")
    lines.append("")
    if base.error is None and ours.error is None:
        diffs = token_differences(base, ours)
        prompts = len(base.tokens[0]) if base.tokens else 0
        counts = sorted({len(t) for call in base.tokens for t in call})
        if diffs:
            lines.append("tokens: DIFFER")
            lines += [f"  {d}" for d in diffs]
        else:
            lines.append(f"tokens: identical ({len(base.tokens)} generate calls x {prompts} "
                         f"prompts, {'/'.join(map(str, counts))} tokens each)")
        for i, t in enumerate(base.tokens[0] if base.tokens else ()):
            lines.append(f"  prompt {i}: {list(t)}")
    else:
        lines.append("tokens: not compared (a run did not finish)")
    lines.append("")
    lines.append("timing:")
    for run in (base, ours):
        receive = [s for w in run.workers for s in w.receive_s]
        broadcast = [s for w in run.workers for s in w.broadcast_s]
        gen = ", ".join(f"{s:.2f} s" for s in run.generate_s) or "-"
        lines.append(f"  {run.label}:")
        lines.append(f"    generate: {gen}")
        all_rows = sum(w.receive_all_rows for w in run.workers)
        rows = [r for w in run.workers for r in w.receive_rows]
        per_step = f"; rows per call: {_counts(rows)}" if rows else ""
        lines.append(f"    PPHandler.receive (non-last ranks): {_ms(receive)}; returned True "
                     f"(every row needs a sample) in {all_rows}{per_step}")
        lines.append(f"    PPHandler.broadcast (last rank): {_ms(broadcast)}")
        prev = [s for w in run.workers if w.pp_rank < w.pp_size - 1 for s in w.prev_s]
        lines.append(f"    PPHandler.get_prev_sampled_outputs (non-last ranks): {_ms(prev)}")
    for run in (base, ours):
        if run.log is not None:
            lines.append(f"  vLLM's output of {run.label}: {run.log}")
        lines += [f"  {n}" for n in run.notes]
    lines.append("")
    why = failures(base, ours, pp_size)
    if why:
        lines.append("FAIL")
        lines += [f"  {w}" for w in why]
    else:
        lines.append(f"PASS: ppsync's handler was built in all {pp_size} workers and its tokens "
                     "are identical to vLLM's own handler's")
    return "\n".join(lines)
