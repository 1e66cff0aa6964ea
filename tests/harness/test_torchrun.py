"""torchrun launches ``ppsync run``: 4 processes on one machine as a
tensor x pipeline layout (TP 2 x PP 2) print one table with 4 rank rows and
exit 0; a worker killed mid-run ends the run, the agent names it and every
other worker exits 1. (Across two network namespaces as two nodes:
test_multihost_netns.)"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from rank_procs import free_port, rank_env

TORCHRUN = Path(sys.executable).with_name("torchrun")


@pytest.mark.timeout(240)
@pytest.mark.skipif(not TORCHRUN.exists(), reason=f"torchrun is not installed ({TORCHRUN})")
def test_torchrun_four_processes_tp2_pp2(tmp_path: Path) -> None:
    env = rank_env(0, 1, 0)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name)
    report = tmp_path / "report.json"
    cmd = [str(TORCHRUN), "--nproc-per-node", "4", "--rdzv-backend", "c10d",
           "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "-m", "ppsync", "run",
           "--pp-size", "2", "--steps", "200", "--spec", "1", "--max-num-reqs", "8",
           "--timeout", "20", "--quiet", "--report", str(report)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=200,
                          check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("rank group role") == 1, proc.stdout
    lines = proc.stdout.strip().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("rank group role"))
    rows = [line.split()[:3] for line in lines[start + 1: start + 5]]
    assert rows == [["0", "0", "receiver"], ["1", "1", "receiver"],
                    ["2", "0", "last"], ["3", "1", "last"]]
    assert re.search(r"world=4 pp_size=2 K=1 .* -> OK: 0 lost / 0 stale", lines[start + 5])
    assert '"world_size": 4' in report.read_text()


def _worker_pids(agent: int) -> dict[int, int]:
    """RANK -> pid of the agent's worker processes."""
    out = subprocess.run(["pgrep", "-P", str(agent)], capture_output=True, text=True,
                         check=False).stdout.split()
    pids: dict[int, int] = {}
    for pid in map(int, out):
        with contextlib.suppress(OSError):
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            for item in environ:
                if item.startswith(b"RANK="):
                    pids[int(item[5:])] = pid
    return pids


@pytest.mark.timeout(240)
@pytest.mark.skipif(not TORCHRUN.exists(), reason=f"torchrun is not installed ({TORCHRUN})")
@pytest.mark.skipif(shutil.which("pgrep") is None, reason="pgrep (procps) is not installed")
def test_torchrun_a_killed_worker_ends_the_run_with_exit_1_everywhere(tmp_path: Path) -> None:
    env = rank_env(0, 1, 0)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name)
    cmd = [str(TORCHRUN), "--nproc-per-node", "3", "--rdzv-backend", "c10d",
           "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "-m", "ppsync", "run",
           "--steps", "1000000", "--max-num-reqs", "8", "--timeout", "5",
           "--progress-every", "0.2"]
    err_path = tmp_path / "torchrun.err"
    with open(err_path, "wb") as err:
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=err)
        try:
            deadline = time.monotonic() + 150
            while "ppsync: step " not in err_path.read_text(errors="replace"):
                assert proc.poll() is None and time.monotonic() < deadline, \
                    err_path.read_text(errors="replace")[-3000:]
                time.sleep(0.1)
            workers = _worker_pids(proc.pid)
            assert sorted(workers) == [0, 1, 2], workers
            os.kill(workers[1], signal.SIGKILL)
            code = proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
    text = err_path.read_text(errors="replace")
    assert code != 0, text[-3000:]
    # the agent names the killed worker and stops the others, which say so and exit 1
    assert re.search(rf"exitcode\s*: -9 \(pid: {workers[1]}\)", text), text[-3000:]
    for r in (0, 2):
        assert re.search(rf"ppsync: rank {r}: (stopped by SIGTERM|PeerLost|SyncTimeout)",
                         text), text[-3000:]
        assert re.search(rf"exitcode\s*: 1 \(pid: {workers[r]}\)", text), text[-3000:]
