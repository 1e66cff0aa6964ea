"""The README's embedding example is a file, and it runs as written: on 3 real
gloo ranks (separate processes on 127.0.0.1), on asyncio and trio, it exits 0
and every rank ends with the same tokens. The README's copy of it cannot
drift from the file."""

from __future__ import annotations

import datetime
import os
import re
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from torch._C._distributed_c10d import TCPStore

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "embed_anyio.py"
README = ROOT / "README.md"
RANKS = 3
TIMEOUT_S = 90  # the whole run; the example bounds each wait by --timeout


def _readme_blocks(marker: str) -> list[str]:
    """The fenced code blocks of README.md right after a ``<!-- marker -->`` line."""
    pattern = rf"<!-- {re.escape(marker)} -->\n```python\n(.*?)```"
    return re.findall(pattern, README.read_text(), flags=re.S)


def test_readme_shows_the_example_file_verbatim() -> None:
    """Each marked README block is a run of the file's lines, verbatim up to
    a common indentation (a block from inside a function is shown dedented)."""
    blocks = _readme_blocks("examples/embed_anyio.py")
    assert len(blocks) >= 2, "README.md lacks blocks marked <!-- examples/embed_anyio.py -->"
    source = EXAMPLE.read_text()
    for block in blocks:
        assert any(textwrap.indent(block, " " * n) in source for n in range(0, 13, 4)), (
            f"README block not in {EXAMPLE.name}:\n{block}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _run_ranks(backend: str, port: int, extra_env: dict[str, str]) -> list[dict[str, str]]:
    """Start RANKS processes of the example, torchrun-style; return each
    rank's printed fields once all exited 0."""
    procs = []
    for rank in range(RANKS):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank),
               "WORLD_SIZE": str(RANKS), "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port), **extra_env}
        procs.append(subprocess.Popen(
            [sys.executable, str(EXAMPLE), "--backend", backend, "--timeout", "30"],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        ))
    outs = []
    try:
        for rank, proc in enumerate(procs):
            out, err = proc.communicate(timeout=TIMEOUT_S)
            assert proc.returncode == 0, f"rank {rank} exited {proc.returncode}:\n{err}"
            outs.append(out)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return [_fields(out) for out in outs]


RANK_LINE = re.compile(r"embed_anyio rank=\d+ [^\n]*?digest=[0-9a-f]{8}")
"""One rank's line (its last field is the 8-digit digest)."""


def _fields(out: str) -> dict[str, str]:
    lines = [line for line in out.splitlines() if line.startswith("embed_anyio ")]
    assert len(lines) == 1, out
    return dict(kv.split("=", 1) for kv in lines[0].split()[1:])


def _check_delivery(ranks: list[dict[str, str]], *, board: bool) -> None:
    assert [r["rank"] for r in ranks] == [str(i) for i in range(RANKS)]
    assert [r["role"] for r in ranks] == ["receiver"] * (RANKS - 1) + ["last"]
    for r in ranks:
        assert r["drained"] == str(RANKS)  # D = pp_size by default
        assert r["board"] == str(board)
    assert int(ranks[-1]["tokens"]) > 0 and int(ranks[-1]["ended"]) > 0
    # every receiver applied exactly the tokens the last rank sampled
    last = ranks[-1]
    for r in ranks[:-1]:
        assert (r["tokens"], r["ended"], r["digest"]) == (
            last["tokens"], last["ended"], last["digest"]), (r, last)


@pytest.mark.timeout(TIMEOUT_S + 30)
@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_example_delivers_every_token_with_a_launcher_store(backend: str) -> None:
    """As under torchrun: a store that outlives the ranks (here this test's),
    every rank a client of it, so the example uses a failure board."""
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                     timeout=datetime.timedelta(seconds=TIMEOUT_S))
    ranks = _run_ranks(backend, store.port, {"TORCHELASTIC_USE_AGENT_STORE": "True"})
    _check_delivery(ranks, board=True)


@pytest.mark.timeout(TIMEOUT_S + 30)
def test_example_delivers_every_token_with_rank0_hosting_the_store() -> None:
    """Without a launcher's store rank 0 hosts it on MASTER_PORT: no board."""
    env = {"TORCHELASTIC_USE_AGENT_STORE": ""}
    ranks = _run_ranks("trio", _free_port(), env)
    _check_delivery(ranks, board=False)


@pytest.mark.timeout(TIMEOUT_S + 30)
def test_example_runs_under_torchrun_as_the_readme_says() -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc-per-node", str(RANKS), str(EXAMPLE), "--timeout", "30"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S, check=False,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    # the ranks share torchrun's stdout: with unbuffered output (PYTHONUNBUFFERED)
    # print() writes a line and its newline apart, so two ranks' lines can run
    # together (seen: "...digest=2eaf1ad3embed_anyio rank=0 ..."): find each
    lines = sorted(RANK_LINE.findall(proc.stdout))
    assert len(lines) == RANKS, (proc.stdout, proc.stderr[-3000:])  # one line per rank
    _check_delivery([_fields(line) for line in lines], board=True)
