"""One vLLM engine run of ``ppsync vllm-check``, bounded: the child process
(ppsync.checks.vllm.engine) in a session of its own, every process of
that session gone when the run ends, and what the run left read back
(ppsync.checks.vllm.report).

A vLLM run starts an engine core and one worker per PP rank, all in the
child's session (vLLM's multiprocessing executor starts no session of its
own); a run that hangs, or dies, leaves them behind otherwise.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import IO

from ppsync.checks.vllm import worker_hooks
from ppsync.checks.vllm.report import (
    RunResult,
    read_workarounds,
    read_worker_records,
    spec_figures,
)
from ppsync.compat.vllm.plugin import ENV_SWITCH
from ppsync.harness import lifetime

__all__ = ["LOG_TAIL", "engine_command", "kill_session", "run_bounded", "run_engine",
           "run_env", "session_processes"]

LOG_TAIL = 40


def session_processes(sid: int) -> list[str]:
    """The live processes of session ``sid`` ("pid state name"; zombies,
    which are gone but for their parent's reaping, left out)."""
    return [f"{pid} {state} {name}" for pid, state, name in lifetime.session_processes(sid)]


def kill_session(sid: int) -> None:
    """SIGKILL every process of session ``sid`` (a stopped one too)."""
    lifetime.kill_session(sid)


def run_bounded(cmd: list[str], env: dict[str, str], out: IO[str], cwd: Path,
                timeout_s: float) -> int | None:
    """Run ``cmd`` in a session of its own, output to ``out``; its exit status,
    or None when it ran past ``timeout_s``. Then (or when the check is
    interrupted) every process left in its session is killed: a vLLM run that
    hangs (or dies) leaves its engine core and workers behind otherwise."""
    proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, cwd=cwd, start_new_session=True)
    rc: int | None = None
    try:
        rc = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        pass
    finally:  # also when the check itself is interrupted
        kill_session(proc.pid)
        proc.wait()
    return rc


def engine_command(spec_file: Path, out: Path) -> list[str]:
    return [sys.executable, "-m", "ppsync.checks.vllm.engine", str(spec_file), str(out)]


def run_env(env: dict[str, str], records: Path, ppsync: bool) -> dict[str, str]:
    """The environment of one run: its records directory, and the plugin
    switched on (ppsync's run) or off (vLLM's)."""
    env = dict(env)
    env[worker_hooks.ENV_RECORD] = str(records)
    if ppsync:
        env[ENV_SWITCH] = "1"
    else:
        env.pop(ENV_SWITCH, None)
    return env


def result_of(label: str, ppsync: bool, run_dir: Path, error: str | None) -> RunResult:
    """What a finished (or stopped) run left in ``run_dir``."""
    out, records = run_dir / "result.json", run_dir / "records"
    result = json.loads(out.read_text()) if out.exists() else {}
    return RunResult(
        label=label, expect_ppsync=ppsync, workers=read_worker_records(records),
        tokens=tuple(tuple(tuple(t) for t in call) for call in result.get("tokens", ())),
        generate_s=tuple(result.get("generate_s", ())), error=error,
        log=str(run_dir / "vllm.log"), spec=spec_figures(result.get("spec")),
        workarounds=read_workarounds(records), caller=result.get("error"),
        ended_at=result.get("ended_at"),
        calls_at=tuple((float(a), float(b)) for a, b in result.get("calls_at", ())))


def run_engine(label: str, ppsync: bool, work: Path, name: str, env: dict[str, str],
               spec_file: Path, timeout_s: float) -> RunResult:
    """One run to its end (bounded by ``timeout_s``) and what it gave."""
    run_dir = work / name
    (run_dir / "records").mkdir(parents=True)
    env = run_env(env, run_dir / "records", ppsync)
    log = run_dir / "vllm.log"
    with log.open("w") as f:
        rc = run_bounded(engine_command(spec_file, run_dir / "result.json"), env, f, work,
                         timeout_s)
    error = None
    if rc is None:
        error = f"still running after {timeout_s:.0f} s (killed, with every process it started)"
    elif rc != 0 or not (run_dir / "result.json").exists():
        tail = log.read_text(errors="replace").splitlines()[-LOG_TAIL:]
        error = f"exit status {rc}; the last lines of {log}:\n" + "\n".join(
            "      " + line for line in tail)
    return result_of(label, ppsync, run_dir, error)
