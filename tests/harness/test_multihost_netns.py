"""Multi-host on one machine: ``ppsync run`` in three network namespaces on a
bridge, each rank configured only by its environment (RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR = host 0's address, MASTER_PORT, GLOO_SOCKET_IFNAME =
the namespace's veth). A clean run delivers exactly and exits 0 everywhere; a
link cut mid-run gives every rank a typed error within timeout + 5 s. Also
torchrun across two namespaces as two nodes. Skipped, with the reason, where
network namespaces cannot be made.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from netns import IFNAME, Hosts, netns_unavailable
from rank_procs import RankProcs, rank_env

WHY_NOT = netns_unavailable()
pytestmark = pytest.mark.skipif(WHY_NOT is not None, reason=str(WHY_NOT))

PORT = 29400  # inside namespaces made for this test: no other process listens there
TIMEOUT_S = 5.0
ARGS = ["--max-num-reqs", "16", "--spec", "2", "--timeout", str(TIMEOUT_S)]


@pytest.fixture
def hosts() -> Iterator[Hosts]:
    h = Hosts(3)
    try:
        yield h
    finally:
        h.remove()


@pytest.fixture
def ranks(tmp_path: Path) -> Iterator[RankProcs]:
    procs = RankProcs(tmp_path)
    try:
        yield procs
    finally:
        procs.close()


def _start(hosts: Hosts, ranks: RankProcs, args: list[str]) -> None:
    for r in range(3):
        env = rank_env(r, 3, PORT, addr=hosts.addr(0), GLOO_SOCKET_IFNAME=IFNAME)
        ranks.start(r, env, [*args, *ARGS], prefix=hosts.exec_prefix(r))


@pytest.mark.timeout(180)
def test_three_hosts_deliver_exactly(hosts: Hosts, ranks: RankProcs) -> None:
    _start(hosts, ranks, ["--steps", "1000", "--quiet"])
    ended = ranks.wait(150)
    assert [ended[r].code for r in range(3)] == [0, 0, 0], [ended[r].err for r in range(3)]
    table = ended[0].out.strip().splitlines()
    assert len(table) == 5, table
    for line in table[1:3]:
        cols = line.split()
        expected, delivered, faults = int(cols[6]), int(cols[8]), cols[9:13]
        assert delivered == expected > 0 and faults == ["0"] * 4, line
    assert re.search(r"world=3 pp_size=3 K=2 .* -> OK: 0 lost", table[4])


@pytest.mark.timeout(180)
def test_a_cut_link_gives_every_rank_a_typed_error_in_time(
    hosts: Hosts, ranks: RankProcs
) -> None:
    _start(hosts, ranks, ["--steps", "1000000", "--progress-every", "0.2"])
    ranks.wait_for_progress(0, 90)
    cut_at = time.monotonic()
    hosts.cut(1)
    ended = ranks.wait(TIMEOUT_S + 5 + 10)  # a hang shows as code None
    for r in range(3):
        e = ended[r]
        assert e.code == 1, (r, e.code, e.err)
        assert e.at - cut_at <= TIMEOUT_S + 5, (r, e.at - cut_at, e.err)
        assert re.search(rf"ppsync: rank {r}: (SyncTimeout|PeerLost): ", e.err), e.err
    # the two ranks that can still reach the store name the cut-off one
    for r in (0, 2):
        assert re.search(r"peer rank\(s\) 1 \(global\)", ended[r].err), ended[r].err


@pytest.mark.timeout(240)
@pytest.mark.skipif(shutil.which("torchrun") is None
                    and not Path(sys.executable).with_name("torchrun").exists(),
                    reason="torchrun is not installed")
def test_torchrun_two_nodes(hosts: Hosts, tmp_path: Path) -> None:
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    procs = []
    for node in range(2):
        env = rank_env(0, 1, PORT, GLOO_SOCKET_IFNAME=IFNAME)
        for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
            env.pop(name)
        cmd = [*hosts.exec_prefix(node), torchrun, "--nnodes", "2", "--nproc-per-node", "2",
               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{hosts.addr(0)}:{PORT}",
               "--rdzv-id", "ppsync-test", "--local-addr", hosts.addr(node),
               # torchrun cannot tell that host 0's veth address is its own
               # (it checks the hostname's addresses): say which node hosts the store
               "--rdzv-conf", f"is_host={'true' if node == 0 else 'false'}",
               "-m", "ppsync", "run", "--pp-size", "2", "--steps", "200", "--quiet", *ARGS]
        out = open(tmp_path / f"node{node}.out", "wb")  # noqa: SIM115 (closed below)
        err = open(tmp_path / f"node{node}.err", "wb")  # noqa: SIM115
        procs.append((subprocess.Popen(cmd, env=env, stdout=out, stderr=err), out, err))
    try:
        codes = [p.wait(timeout=200) for p, _, _ in procs]
    finally:
        for p, out, err in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
            out.close()
            err.close()
    texts = [(tmp_path / f"node{n}.out").read_text() for n in range(2)]
    errs = [(tmp_path / f"node{n}.err").read_text()[-3000:] for n in range(2)]
    assert codes == [0, 0], errs
    tables = [t for t in texts if "rank group role" in t]
    assert len(tables) == 1, texts  # world rank 0 prints the one table
    rows = [line.split()[:3] for line in tables[0].splitlines()[1:5]]
    assert rows == [["0", "0", "receiver"], ["1", "1", "receiver"],
                    ["2", "0", "last"], ["3", "1", "last"]]
    assert re.search(r"world=4 pp_size=2 .* -> OK", tables[0])
