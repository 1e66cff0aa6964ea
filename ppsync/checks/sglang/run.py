"""One bounded engine run of ``ppsync sglang-check``: the child process, its
events, its end, and the processes it leaves.

The child (ppsync.checks.sglang.engine) runs in a session of its
own, so every process SGLang starts (its schedulers, its detokenizer) is
found by session id at the end, counted, and killed: no run leaves a
process behind, a stopped one included.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ppsync.checks.sglang.engine import EVENT_PREFIX
from ppsync.harness.lifetime import kill_session, session_processes

GUARD_ACTIVE = re.compile(r"ppsync: guard active on SGLang PP stage (\d+) of (\d+)")
PPSYNC_ERROR = re.compile(r"^ppsync: SGLang PP stage (\d+) \(global rank \d+\): (\w+): (.*)$")
STAGE_NAMED = re.compile(r"PP stage (\d+) \(global rank (\d+)\) is (lost|silent)")
_EXCEPTION_LINE = re.compile(r"^([\w.]+(?:Error|Exception|Timeout|Lost)): (.*)$")


@dataclass
class RunSpec:
    """One engine run: what the child does and the environment it gets."""

    name: str
    python: str
    work_dir: Path
    pp_size: int
    prompts: list[list[int]]
    max_tokens: int
    seed: int
    fault: str | None
    env: dict[str, str]
    after_fault_s: float
    """How long the run may go on after the fault before it counts as hung."""
    limit_s: float
    """Bound on the whole run (start-up included)."""


@dataclass
class RunResult:
    """What one run showed."""

    name: str
    after_fault_s: float = 0.0
    """The run's bound after the fault (see RunSpec)."""
    events: list[dict[str, Any]] = field(default_factory=list)
    stderr: str = ""
    exit_code: int | None = None
    ended: bool = False
    """The child exited, or reported shutdown, before the bound."""
    seconds_after_fault: float | None = None
    """From the fault to the end (exit, error or shutdown); None: no fault or no end."""
    named_after_fault: float | None = None
    """From the fault to the first error the guard printed (a stage's verdict,
    seen in the run's stderr, polled every 0.1 s); None: none after a fault."""
    processes_left: int = 0
    """Processes of the run's session alive at its end, before they were killed."""
    processes_after_cleanup: int = 0

    def tokens(self, call: int) -> list[list[int]] | None:
        for e in self.events:
            if e["event"] == "tokens" and e.get("call") == call:
                tokens: list[list[int]] = e["tokens"]
                return tokens
        return None

    def event(self, name: str) -> dict[str, Any] | None:
        return next((e for e in self.events if e["event"] == name), None)

    def event_where(self, name: str, call: int) -> dict[str, Any] | None:
        """The event ``name`` of generate call ``call``."""
        return next((e for e in self.events if e["event"] == name and e.get("call") == call),
                    None)

    def active_stages(self) -> set[int]:
        return {int(m.group(1)) for m in GUARD_ACTIVE.finditer(self.stderr)}

    def ppsync_errors(self) -> list[tuple[int, str, str]]:
        """(stage, error type, message) of each error the guard raised."""
        out = []
        for line in self.stderr.splitlines():
            m = PPSYNC_ERROR.match(line)
            if m:
                out.append((int(m.group(1)), m.group(2), m.group(3)))
        return out

    def caller_error(self) -> str:
        """The error the engine's caller saw: generate()'s exception, else
        how the engine process ended, with the last exception a scheduler
        logged."""
        err = self.event("error")
        if err is not None:
            return f"generate() raised {err['type']}: {err['message'][:300]}"
        last = ""
        for line in self.stderr.splitlines():
            m = _EXCEPTION_LINE.match(line.strip())
            if m:
                last = f"{m.group(1)}: {m.group(2)[:300]}"
        if not self.ended:
            return f"none yet (generate() still blocked); scheduler: {last or 'no error logged'}"
        how = ("exited normally" if self.exit_code == 0 else
               f"engine process killed by {_signal_name(self.exit_code)}"
               if self.exit_code is not None and self.exit_code < 0 else
               f"engine process exited {self.exit_code}")
        return f"{how}; scheduler: {last or 'no error logged'}"


def _signal_name(code: int | None) -> str:
    try:
        return signal.Signals(-(code or 0)).name
    except ValueError:
        return f"signal {-(code or 0)}"


def session_pids(sid: int) -> list[int]:
    """Live processes whose session id is ``sid``."""
    return [pid for pid, _, _ in session_processes(sid)]


def _kill_session(sid: int) -> int:
    """SIGKILL every process of session ``sid``; the number still alive after."""
    return kill_session(sid)


def _events(stdout: str) -> list[dict[str, Any]]:
    out = []
    for line in stdout.splitlines():
        if line.startswith(EVENT_PREFIX):
            try:
                out.append(json.loads(line[len(EVENT_PREFIX):]))
            except json.JSONDecodeError:
                continue
    return out


def run_engine(spec: RunSpec) -> RunResult:
    """Run ``spec`` once, bounded; every process it started is gone after."""
    directory = spec.work_dir / spec.name
    directory.mkdir(parents=True, exist_ok=True)
    spec_file = directory / "spec.json"
    spec_file.write_text(json.dumps({
        "work_dir": str(directory), "pp_size": spec.pp_size, "prompts": spec.prompts,
        "max_tokens": spec.max_tokens, "seed": spec.seed, "fault": spec.fault}))
    package_root = str(Path(__file__).resolve().parents[3])  # this ppsync, in the child too
    env = {**os.environ, **spec.env,
           "PYTHONPATH": os.pathsep.join(p for p in (package_root,
                                                     os.environ.get("PYTHONPATH")) if p)}
    out_path, err_path = directory / "stdout.txt", directory / "stderr.txt"
    result = RunResult(spec.name, spec.after_fault_s)
    with open(out_path, "w") as out, open(err_path, "w") as err:
        child = subprocess.Popen(
            [spec.python, "-m", "ppsync.checks.sglang.engine", str(spec_file)],
            stdout=out, stderr=err, stdin=subprocess.DEVNULL, env=env,
            start_new_session=True)
    start = time.monotonic()
    fault_at: float | None = None
    while True:
        code = child.poll()
        result.events = _events(out_path.read_text())
        fault = result.event("fault")
        if fault is not None and fault_at is None:
            fault_at = time.monotonic()
        if fault_at is not None and result.named_after_fault is None and any(
                PPSYNC_ERROR.match(line)
                for line in err_path.read_text(errors="replace").splitlines()):
            result.named_after_fault = time.monotonic() - fault_at
        ended = code is not None or result.event("shutdown") is not None or (
            fault_at is not None and result.event("error") is not None)
        if ended:
            result.ended = True
            if fault_at is not None:
                result.seconds_after_fault = time.monotonic() - fault_at
            break
        now = time.monotonic()
        if now - start > spec.limit_s or (fault_at is not None
                                          and now - fault_at > spec.after_fault_s):
            break
        time.sleep(0.1)
    if result.ended and code is None:
        # shut down or raised: give it a moment to exit by itself
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.wait(timeout=15)
    result.exit_code = child.poll()
    result.processes_left = len(session_pids(child.pid))
    result.processes_after_cleanup = _kill_session(child.pid)
    if child.poll() is None:
        child.kill()
    child.wait()
    result.events = _events(out_path.read_text())
    result.stderr = err_path.read_text(errors="replace")
    return result


def sglang_python() -> str:
    """This interpreter: ``ppsync sglang-check`` runs from SGLang's venv."""
    return sys.executable
