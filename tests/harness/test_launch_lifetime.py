"""``ppsync launch`` as a real process: what it leaves behind when it is told
to stop, when it is killed, and when one of its ranks stops answering.

- SIGTERM (what ``timeout``, CI runners and ``docker stop`` send) ends every
  rank and the store process: none is left 10 s later, and launch says why
  in one line, exit code 1.
- SIGKILL to launch (no cleanup can run): its children end with it.
- A SIGSTOPped rank: the survivors fail on their own timeout and launch
  ends the stuck rank after a grace, within ``--timeout`` plus the stall
  grace, and still writes its report (``--report``), marked incomplete,
  with what every rank had checked by then; no stack is printed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ppsync.harness.lifetime import kill_session, session_processes
from ppsync.harness.local_run import STALL_GRACE_S
from ppsync.schemas.run_report import RunReport

LAUNCH = [sys.executable, "-m", "ppsync", "launch", "--pp-size", "2", "--steps", "10000000",
          "--timeout", "5", "--max-num-reqs", "8", "--progress-every", "0.5"]


def _children(pid: int) -> list[int]:
    """Every process whose parent is ``pid``, from /proc."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            out.append(int(entry.name))
    return out


def _started(pid: int) -> int:
    """The clock tick ``pid`` started at (/proc/PID/stat, field 22)."""
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])


def _alive(pid: int) -> bool:
    """Running, stopped or sleeping: anything but gone or a zombie (PID 1
    in a container may never reap what it inherits)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


class Launch:
    """A ``ppsync launch`` process, its stderr in a file, its children."""

    def __init__(self, tmp: Path, *extra: str) -> None:
        self.err_path = tmp / "launch.err"
        self.out_path = tmp / "launch.out"
        self.report = tmp / "report.json"
        with open(self.err_path, "wb") as err, open(self.out_path, "wb") as out:
            self.proc = subprocess.Popen([*LAUNCH, "--report", str(self.report), *extra],
                                         stdout=out, stderr=err)
        self.children: list[int] = []

    def err(self) -> str:
        return self.err_path.read_text(errors="replace")

    def wait_mid_run(self, timeout_s: float = 60.0) -> None:
        """Until rank 0 printed a progress line; then note the children
        (the store process and both ranks)."""
        deadline = time.monotonic() + timeout_s
        while "ppsync: step " not in self.err():
            assert self.proc.poll() is None, self.err()
            assert time.monotonic() < deadline, f"no progress line:\n{self.err()}"
            time.sleep(0.1)
        self.children = sorted(_children(self.proc.pid), key=_started)
        assert len(self.children) == 3, self.children

    def ended_within(self, timeout_s: float) -> float | None:
        """Seconds until launch exited, None if it did not within timeout_s."""
        t0 = time.monotonic()
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return None
        return time.monotonic() - t0

    def left_after(self, wait_s: float) -> list[int]:
        """The children still alive ``wait_s`` seconds from now (or sooner,
        once every one has ended)."""
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline and any(_alive(p) for p in self.children):
            time.sleep(0.1)
        return [p for p in self.children if _alive(p)]

    def close(self) -> None:
        for pid in [self.proc.pid, *self.children]:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        self.proc.wait(timeout=10)


@pytest.fixture
def launch(tmp_path: Path) -> Iterator[Launch]:
    run = Launch(tmp_path)
    try:
        yield run
    finally:
        run.close()


@pytest.mark.timeout(120)
def test_sigterm_to_launch_ends_every_rank_and_the_store(launch: Launch) -> None:
    launch.wait_mid_run()
    # each process shows its role in `ps -e` / top (the kernel's comm, 15 bytes)
    names = [Path(f"/proc/{p}/comm").read_text().strip() for p in launch.children]
    assert names == ["ppsync store", "ppsync r0 recv", "ppsync r1 last"], names
    t0 = time.monotonic()
    launch.proc.send_signal(signal.SIGTERM)
    took = launch.ended_within(10.0)
    left = launch.left_after(max(0.0, 10.0 - (time.monotonic() - t0)))
    assert took is not None, f"launch still running 10 s after SIGTERM:\n{launch.err()}"
    assert left == [], f"left running 10 s after SIGTERM: {left}"
    assert launch.proc.returncode == 1, launch.err()
    assert "ppsync: launch stopped by SIGTERM" in launch.err(), launch.err()
    assert "Traceback" not in launch.err(), launch.err()


@pytest.mark.timeout(120)
def test_the_children_end_when_launch_is_killed(launch: Launch) -> None:
    launch.wait_mid_run()
    launch.proc.send_signal(signal.SIGKILL)
    assert launch.ended_within(10.0) is not None
    assert launch.left_after(10.0) == [], "the ranks or the store outlived launch"


@pytest.mark.timeout(150)
def test_a_stopped_rank_does_not_hold_launch_past_its_timeout(launch: Launch) -> None:
    launch.wait_mid_run()
    rank1 = launch.children[-1]  # in start order: the store process, rank 0, rank 1
    os.kill(rank1, signal.SIGSTOP)
    bound = 5 + STALL_GRACE_S  # --timeout 5: rank 1 makes no step for this long
    took = launch.ended_within(bound + 10)  # + the launcher's poll, the ranks' end
    assert took is not None, f"launch still running {bound + 10} s after rank 1 stopped:\n" + (
        launch.err())
    assert launch.left_after(10.0) == []
    err = launch.err()
    assert launch.proc.returncode == 1, err
    assert "RankFailed" in err and "silent peer rank(s) 1" in err, err
    assert "Traceback" not in err and "Thread 0x" not in err, err  # no stack unless asked
    report = RunReport.model_validate_json(launch.report.read_text())
    assert report.ended is not None and "RankFailed" in report.ended
    assert not report.ok
    receiver = report.ranks[0]
    assert receiver.steps > 0 and receiver.rows_delivered > 0  # what it checked by then
    assert receiver.faults == 0
    assert "INCOMPLETE" in launch.out_path.read_text()


@pytest.mark.timeout(120)
def test_the_dumps_of_a_sigterm_stopped_launch_read_stopped(tmp_path: Path) -> None:
    """Every rank dumps as the launcher passes SIGTERM on; ``dump show``
    reads STOPPED by SIGTERM (not OK), exit 4; its JSON into a pipe closed
    after one line ends quietly, no traceback."""
    dumps = tmp_path / "dumps"
    run = Launch(tmp_path, "--dump-dir", str(dumps))
    try:
        run.wait_mid_run()
        run.proc.send_signal(signal.SIGTERM)
        assert run.ended_within(10.0) is not None, run.err()
    finally:
        run.close()
    assert "INCOMPLETE" in run.out_path.read_text()
    report = RunReport.model_validate_json(run.report.read_text())
    assert report.ended is not None and "SIGTERM" in report.ended
    show = subprocess.run([sys.executable, "-m", "ppsync", "dump", "show", str(dumps)],
                          capture_output=True, text=True, timeout=60)
    assert show.returncode == 4, show.stdout + show.stderr
    assert "world verdict: STOPPED by SIGTERM" in show.stdout, show.stdout
    assert "stopped by SIGTERM" in show.stdout  # each rank's line says so
    for head in ("head -1", "head -0"):  # head -0 closes the pipe before any write
        piped = subprocess.run(
            f"{sys.executable} -m ppsync dump show --json {dumps} | {head}; "
            "exit ${PIPESTATUS[0]}", shell=True, executable="/bin/bash",
            capture_output=True, text=True, timeout=60)
        assert piped.stdout == ("{\n" if head == "head -1" else ""), piped.stdout
        assert "Traceback" not in piped.stderr and "BrokenPipe" not in piped.stderr, (
            piped.stderr)


def test_a_session_is_listed_and_killed_whole_even_stopped() -> None:
    """What vllm-check and sglang-check end their engine runs with."""
    proc = subprocess.Popen(["sh", "-c", "sleep 30 & sleep 30"], start_new_session=True)
    try:
        deadline = time.monotonic() + 5
        while len(session_processes(proc.pid)) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        members = session_processes(proc.pid)
        assert [name for _, _, name in members].count("sleep") == 2, members
        os.kill(members[-1][0], signal.SIGSTOP)
        assert kill_session(proc.pid) == 0
        proc.wait(5)
        assert session_processes(proc.pid) == []
    finally:
        if proc.poll() is None:
            proc.kill()
