"""The side-by-side report of one ``ppsync sglang-check`` case."""

from __future__ import annotations

from dataclasses import dataclass, field

from ppsync.checks.sglang.run import STAGE_NAMED, RunResult

__all__ = ["Verdict", "format_case", "outcome_rows"]

_WIDTH = 60


@dataclass
class Verdict:
    passed: bool
    problems: list[str] = field(default_factory=list)


def _stage_named(run: RunResult) -> str:
    when = ("" if run.named_after_fault is None
            else f", {run.named_after_fault:.1f} s after the fault")
    for stage, kind, message in run.ppsync_errors():
        m = STAGE_NAMED.search(message)
        if m:
            return f"PP stage {m.group(1)} (global rank {m.group(2)}), {m.group(3)}{when}"
        if kind == "DesyncError":
            return f"DesyncError on stage {stage}"
    return "none"


def _end(run: RunResult) -> str:
    if run.event("fault") is None:
        return "ended" if run.ended else "still running at its bound"
    if run.ended and run.seconds_after_fault is not None:
        return f"{run.seconds_after_fault:.1f} s after the fault"
    return f"still hung after {run.after_fault_s:g} s"


def _stall(run: RunResult) -> str:
    stall = run.event("slow")
    if stall is None:
        return "-"
    return (f"{float(stall['seconds']):.1f} s on stage {stall['stage']}, before its run_batch "
            f"{stall['step']}")


def outcome_rows(run: RunResult) -> list[tuple[str, str]]:
    """(label, value) rows of one run's outcome."""
    return [
        ("error the caller saw", run.caller_error()),
        ("stage named", _stage_named(run)),
        ("end", _end(run)),
        ("stall in one step", _stall(run)),
        ("guard active on stages", ", ".join(map(str, sorted(run.active_stages()))) or "none"),
        ("processes left at the end", str(run.processes_left)),
        ("processes after cleanup", str(run.processes_after_cleanup)),
        ("first tokens", str(run.tokens(0))),
    ]


def _cell(text: str) -> str:
    return text if len(text) <= _WIDTH else text[:_WIDTH - 3] + "..."


def format_case(case: str, alone: RunResult | None, guarded: RunResult,
                verdict: Verdict) -> str:
    """The case as a table: SGLang alone beside SGLang with ppsync, then
    the full error lines, then the verdict."""
    rows_g = outcome_rows(guarded)
    rows_a = outcome_rows(alone) if alone is not None else [(k, "-") for k, _ in rows_g]
    lines = [f"== sglang-check case {case}",
             f"{'':28}{'SGLang alone':{_WIDTH + 2}}SGLang with ppsync"]
    for (label, a), (_, g) in zip(rows_a, rows_g, strict=True):
        lines.append(f"{label:28}{_cell(a):{_WIDTH + 2}}{_cell(g)}")
    for name, run in (("SGLang alone", alone), ("with ppsync", guarded)):
        if run is not None:
            lines.append(f"  {name}, the caller: {run.caller_error()}")
    for stage, kind, message in guarded.ppsync_errors():
        lines.append(f"  ppsync on stage {stage}: {kind}: {message}")
    lines.append(f"  {case}: {'PASS' if verdict.passed else 'FAIL'}"
                 + "".join(f"\n    - {p}" for p in verdict.problems))
    return "\n".join(lines)
