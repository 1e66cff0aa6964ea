"""``ppsync vllm-check --fault``: one PP worker killed or stopped while the
engine generates, once with vLLM's own handler and once with ppsync's, and
how each engine ended.

The faulted worker signals itself at its N-th step (the check's worker
hooks, ``PPSYNC_VLLM_CHECK_FAULT``): ``kill-last`` SIGKILLs the last PP
rank, ``stop-last`` SIGSTOPs it (a silent peer: alive, never sends),
``kill-first`` SIGKILLs PP rank 0. The check then watches the run: the
error the caller of ``generate`` saw (type and first line) and when, which
PP rank was named, by whom and when (the caller's error, a worker's error as
the hooks recorded it, or vLLM's executor, which logs a worker process that
died: by its log line's stamp, whole seconds, read as the latest it can
mean), the seconds from the fault to the end, or "still hung" at
``fault_bound_s`` after the fault; and the processes still alive
:data:`GRACE_S` after the caller's process ended (or at the bound). Then
every process of the run is killed, and the check says whether any
survived that.

ppsync's run passes when the faulted PP rank was named within its bound
(:func:`naming_bound_s`) + :data:`SLACK_S` of the fault, the engine ended
(not still hung at the bound; how long vLLM's executor then takes to stop
its workers is reported), and no process was left; vLLM's run is reported,
not judged. The bound follows the failure model (docs/design.md): a
stopped rank is silent, named ``silent_s`` (read from the settings ppsync's
run gets; 15 s by default) after its heartbeat stopped; a killed one is
dead, named about at once (:data:`DEAD_S`). Nothing counts ``timeout_s``,
the bound on a wait for a live peer: the fault runs keep its default. With
TP = 1 (this check's engines) a global rank is the PP rank.
"""

from __future__ import annotations

import re
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from ppsync.checks.vllm import worker_hooks
from ppsync.checks.vllm.report import RunResult, read_worker_records
from ppsync.checks.vllm.runs import (
    engine_command,
    kill_session,
    result_of,
    run_env,
    session_processes,
)

__all__ = ["DEAD_S", "FAULTS", "GRACE_S", "SLACK_S", "FaultOutcome", "bound_text",
           "fault_failures", "fault_target", "format_faults", "naming_bound_s", "run_fault"]

FAULTS = ("kill-last", "stop-last", "kill-first")
GRACE_S = 5.0
"""How long after the caller's process ended the check looks for processes left."""
SLACK_S = 5.0
"""ppsync's run must name the faulted rank within its bound plus this."""
DEAD_S = 1.0
"""A dead rank is named within about this: a connection error at once on a
rank with a transfer pending with it, the board tells the others at their
next look (docs/design.md, "The failure model")."""
PPSYNC_NAMES = re.compile(r"rank(?:\(s\))? (\d+)(?:, \d+)* \(global\)")
VLLM_DIED = re.compile(r"(?:(\d\d)-(\d\d) (\d\d):(\d\d):(\d\d) \[[^\]]*\] )?"
                       r"Worker proc VllmWorker-(\d+) died unexpectedly")
"""vLLM's executor's line for a worker that died, after its log stamp
(local time, MM-DD HH:MM:SS) where there is one."""


def fault_target(fault: str, pp_size: int) -> tuple[str, int]:
    """(signal action, PP rank) of ``fault``."""
    action, where = fault.split("-")
    return action, pp_size - 1 if where == "last" else 0


def naming_bound_s(fault: str, silent_s: float) -> float:
    """How long after ``fault`` ppsync may take to name the faulted rank
    (before :data:`SLACK_S`): ``silent_s`` for a stopped one (its heartbeat
    stopped), :data:`DEAD_S` for a killed one."""
    action, _ = fault.split("-")
    return silent_s if action == "stop" else DEAD_S


@dataclass(frozen=True)
class FaultOutcome:
    """How one engine ended after its fault."""

    run: RunResult
    fault: str
    rank: int  # the faulted PP rank
    fault_t: float | None  # when the worker signalled itself (None: it never got there)
    exited_after_s: float | None  # the caller's process ended (None: still running at the bound)
    bound_s: float
    left: tuple[str, ...]  # processes alive GRACE_S after the end, or at the bound
    survived_kill: tuple[str, ...]  # processes alive after the check killed the session
    named: int | None = None  # the PP rank named
    named_by: str = ""  # who named it
    named_after_s: float | None = None

    @property
    def ended_after_s(self) -> float | None:
        """From the fault to the error the caller saw."""
        if self.run.ended_at is None or self.fault_t is None:
            return None
        return self.run.ended_at - self.fault_t


def _named(run: RunResult, rank: int, fault_t: float) -> tuple[int | None, str, float | None]:
    """The PP rank named after the fault, by whom and when (s after it)."""
    caller = run.caller or {}
    m = PPSYNC_NAMES.search(caller.get("text", ""))
    if m and run.ended_at is not None:
        return int(m.group(1)), "the caller's error", run.ended_at - fault_t
    errors = sorted((t, w.pp_rank, typ, line) for w in run.workers
                    for t, _, typ, line in w.errors if t >= fault_t)
    for t, pp_rank, typ, line in errors:
        m = PPSYNC_NAMES.search(line)
        if m:
            return int(m.group(1)), f"PP rank {pp_rank}'s {typ} (ppsync)", t - fault_t
    if run.log is not None and Path(run.log).exists():
        m = VLLM_DIED.search(Path(run.log).read_text(errors="replace"))
        if m:
            logged = logged_at(m, fault_t)
            when = (logged - fault_t if logged is not None else
                    None if run.ended_at is None else run.ended_at - fault_t)
            return int(m.group(6)), "vLLM's executor (a worker process died)", when
    return None, "", None


def logged_at(m: re.Match[str], near: float) -> float | None:
    """When vLLM logged the line ``m`` of :data:`VLLM_DIED`, at the latest:
    its stamp (local time, whole seconds, the year of ``near``) + 1 s; None
    without a stamp."""
    if m.group(1) is None:
        return None
    year = time.localtime(near).tm_year
    month, day, hour, minute, second = (int(m.group(i)) for i in range(1, 6))
    return time.mktime((year, month, day, hour, minute, second, 0, 0, -1)) + 1.0


def run_fault(label: str, ppsync: bool, work: Path, name: str, env: dict[str, str],
              spec_file: Path, fault: str, pp_size: int, after: int, timeout_s: float,
              bound_s: float) -> FaultOutcome:
    """One engine run with ``fault`` at the faulted worker's ``after``-th
    step; watched until the caller's process ends, or ``bound_s`` after the
    fault (``timeout_s`` in all if the fault never comes)."""
    run_dir = work / name
    records = run_dir / "records"
    records.mkdir(parents=True)
    action, rank = fault_target(fault, pp_size)
    env = run_env(env, records, ppsync)
    env[worker_hooks.ENV_FAULT] = f"{action}:{rank}:{after}"
    log = run_dir / "vllm.log"
    exited_at: float | None = None
    fault_t: float | None = None
    with log.open("w") as f:
        proc = subprocess.Popen(engine_command(spec_file, run_dir / "result.json"), env=env,
                                stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                cwd=work, start_new_session=True)
        try:
            started = time.monotonic()
            while proc.poll() is None:
                fault_t = fault_t or _fault_time(records)
                if fault_t is None and time.monotonic() - started > timeout_s:
                    break
                if fault_t is not None and time.time() - fault_t > bound_s:
                    break
                time.sleep(0.2)
            if proc.poll() is not None:
                exited_at = time.time()
                time.sleep(GRACE_S)
            fault_t = fault_t or _fault_time(records)
            left = tuple(p for p in session_processes(proc.pid)
                         if exited_at is None or not p.startswith(f"{proc.pid} "))
        finally:
            kill_session(proc.pid)
            proc.wait()
    for _ in range(50):
        survived = session_processes(proc.pid)
        if not survived:
            break
        time.sleep(0.1)
    run = result_of(label, ppsync, run_dir, None)
    named = _named(run, rank, fault_t) if fault_t is not None else (None, "", None)
    return FaultOutcome(
        run=run, fault=fault, rank=rank, fault_t=fault_t,
        exited_after_s=None if exited_at is None or fault_t is None else exited_at - fault_t,
        bound_s=bound_s, left=left, survived_kill=tuple(survived), named=named[0],
        named_by=named[1], named_after_s=named[2])


def _fault_time(records: Path) -> float | None:
    for w in read_worker_records(records):
        if w.fault is not None:
            return w.fault[0]
    return None


def bound_text(fault: str, silent_s: float) -> str:
    """``fault``'s bound to name the rank, as the report words it."""
    bound = naming_bound_s(fault, silent_s)
    what = "silent_s" if fault.startswith("stop") else "dead"
    return f"{fault}: {what} {bound:g} + {SLACK_S:g} = {bound + SLACK_S:g} s"


def fault_failures(o: FaultOutcome, silent_s: float) -> list[str]:
    """Why ppsync's run of a fault fails (vLLM's run is not judged);
    ``silent_s``: the one ppsync's run was given."""
    out = []
    label = f"{o.run.label}, {o.fault}"
    limit = naming_bound_s(o.fault, silent_s) + SLACK_S
    if o.fault_t is None:
        return [f"{label}: PP rank {o.rank} never reached the step of its fault"]
    if o.ended_after_s is None:
        out.append(f"{label}: the engine did not end ({_ended(o)})")
    if o.named != o.rank:
        out.append(f"{label}: the faulted PP rank {o.rank} was not named"
                   + (f" (PP rank {o.named} was)" if o.named is not None else ""))
    elif o.named_after_s is None or o.named_after_s > limit:
        when = "at a time not known" if o.named_after_s is None else \
            f"only {o.named_after_s:.1f} s after the fault"
        out.append(f"{label}: PP rank {o.rank} named {when} (bound {limit:g} s)")
    if o.left:
        out.append(f"{label}: processes left: {', '.join(o.left)}")
    return out


def _ended(o: FaultOutcome) -> str:
    if o.ended_after_s is not None:
        return f"generate raised {o.ended_after_s:.1f} s after the fault"
    if o.exited_after_s is not None:
        return f"the caller's process ended {o.exited_after_s:.1f} s after the fault"
    return f"still hung after {o.bound_s:.0f} s"


def _outcome_lines(o: FaultOutcome) -> list[str]:
    caller = o.run.caller
    saw = (f"{caller['type']}: {caller['first_line']}" if caller else
           "no error (generate did not return)" if o.exited_after_s is None else
           "no error recorded")
    named = (f"PP rank {o.named}, by {o.named_by}"
             + (f", {o.named_after_s:.1f} s after the fault" if o.named_after_s is not None
                else "") if o.named is not None else "none")
    errors = [f"PP rank {w.pp_rank} {call}: {typ}: {line[:160]}" for w in o.run.workers
              for _, call, typ, line in w.errors[:1]]
    return [f"  {o.run.label}:",
            f"    the caller of generate saw: {saw}",
            f"    PP rank named: {named}",
            f"    end: {_ended(o)}",
            f"    processes left: {', '.join(o.left) if o.left else 'none'}"
            + (f"; alive even after the check's kill: {', '.join(o.survived_kill)}"
               if o.survived_kill else ""),
            *(f"    worker error: {e}" for e in errors),
            f"    vLLM's output: {o.run.log}"]


def format_faults(outcomes: list[FaultOutcome], pp_size: int, silent_s: float) -> str:
    """Both handlers' outcomes of each fault side by side, and the verdict
    (``silent_s``: the one ppsync's run was given)."""
    lines = []
    for fault in dict.fromkeys(o.fault for o in outcomes):
        runs = [o for o in outcomes if o.fault == fault]
        action, rank = fault_target(fault, pp_size)
        step = next((w.fault[2] for o in runs for w in o.run.workers if w.fault), "?")
        lines.append(f"fault {fault}: PP rank {rank} of {pp_size} sent itself "
                     f"{worker_hooks.FAULT_SIGNALS[action]} at its step {step}")
        for o in runs:
            lines += _outcome_lines(o)
    why = [w for o in outcomes if o.run.expect_ppsync for w in fault_failures(o, silent_s)]
    lines.append("")
    if why:
        lines.append("FAIL")
        lines += [f"  {w}" for w in why]
    else:
        bounds = "; ".join(dict.fromkeys(bound_text(o.fault, silent_s) for o in outcomes))
        lines.append(f"PASS: with ppsync's handler every fault named the faulted PP rank "
                     f"within its bound ({bounds}) and ended the engine, leaving no process "
                     "(vLLM's handler: reported above, not judged)")
    return "\n".join(lines)
