"""Start ``python -m ppsync run`` ranks as real processes, configured only by
the environment, and collect what each printed and how it ended."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

PROGRESS = "ppsync: step "  # the start of rank 0's progress line


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def rank_env(rank: int, world_size: int, port: int, addr: str = "127.0.0.1",
             **extra: str) -> dict[str, str]:
    """torchrun's variables for one rank, on top of this process's environment
    (without any torchrun variable the test runner itself may carry)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHELASTIC_")}
    env.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK="0",
               MASTER_ADDR=addr, MASTER_PORT=str(port), **extra)
    return env


@dataclass
class Ended:
    """How one rank process ended."""

    rank: int
    code: int | None  # None: still running when the wait ran out (then killed)
    out: str
    err: str
    at: float  # time.monotonic() when it was seen to end


class RankProcs:
    """Rank processes writing stdout/stderr to files under ``tmp``."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.procs: dict[int, subprocess.Popen[bytes]] = {}

    def start(self, rank: int, env: Mapping[str, str], args: Sequence[str],
              prefix: Sequence[str] = ()) -> None:
        cmd = [*prefix, sys.executable, "-m", "ppsync", "run", *args]
        with open(self._path(rank, "out"), "wb") as out, \
                open(self._path(rank, "err"), "wb") as err:
            self.procs[rank] = subprocess.Popen(cmd, env=dict(env), stdout=out, stderr=err)

    def _path(self, rank: int, kind: str) -> Path:
        return self.tmp / f"rank{rank}.{kind}"

    def text(self, rank: int, kind: str) -> str:
        return self._path(rank, kind).read_text(errors="replace")

    def wait_for_progress(self, rank: int, timeout_s: float) -> None:
        """Until ``rank`` printed a progress line (the run is mid-way)."""
        deadline = time.monotonic() + timeout_s
        while PROGRESS not in self.text(rank, "err"):
            if time.monotonic() > deadline or self.procs[rank].poll() is not None:
                raise AssertionError(f"rank {rank} printed no progress line:\n"
                                     + self.text(rank, "err"))
            time.sleep(0.05)

    def kill(self, rank: int) -> float:
        self.procs[rank].send_signal(signal.SIGKILL)
        self.procs[rank].wait(timeout=10)
        return time.monotonic()

    def wait(self, timeout_s: float) -> dict[int, Ended]:
        """Every process's end; any still running after ``timeout_s`` is
        killed and reported with code None."""
        deadline = time.monotonic() + timeout_s
        ended: dict[int, Ended] = {}
        while len(ended) < len(self.procs) and time.monotonic() < deadline:
            for rank, p in self.procs.items():
                if rank not in ended and p.poll() is not None:
                    ended[rank] = Ended(rank, p.returncode, "", "", time.monotonic())
            time.sleep(0.02)
        for rank, p in self.procs.items():
            if rank not in ended:
                p.kill()
                p.wait(timeout=10)
                ended[rank] = Ended(rank, None, "", "", time.monotonic())
        for e in ended.values():
            e.out, e.err = self.text(e.rank, "out"), self.text(e.rank, "err")
        return ended

    def close(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
