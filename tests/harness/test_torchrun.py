"""torchrun launches ``ppsync run``: 4 processes on one machine as a
tensor x pipeline layout (TP 2 x PP 2) print one table with 4 rank rows and
exit 0. (Across two network namespaces as two nodes: test_multihost_netns.)"""

from __future__ import annotations

import re
import subprocess
import sys
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
