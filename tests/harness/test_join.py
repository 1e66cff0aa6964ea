"""Joining the world (``ppsync run``): scoped to one run, bounded, and
interruptible.

- Two runs, one after the other, against one long-lived store (torchrun's
  agent store, ``TORCHELASTIC_USE_AGENT_STORE=True``, kept by this test
  process): the second run does not read the first one's keys and both
  complete, well within the join timeout.
- A rank SIGTERMed while it waits for its peers (or for the store) ends
  within a second or so, exit code 1, with a line saying it was joining.
- A peer that never arrives is named when the join times out.
"""

from __future__ import annotations

import datetime
import signal
import time
from pathlib import Path

import pytest
from rank_procs import RankProcs, free_port, rank_env
from torch._C._distributed_c10d import TCPStore

RUN_ARGS = ["--pp-size", "2", "--steps", "40", "--max-num-reqs", "8", "--timeout", "20",
            "--quiet"]


@pytest.mark.timeout(150)
def test_two_runs_against_one_long_lived_store_both_join(tmp_path: Path) -> None:
    port = free_port()
    store = TCPStore("127.0.0.1", port, 3, is_master=True, wait_for_workers=False,
                     timeout=datetime.timedelta(seconds=60))
    try:
        for run in range(2):
            procs = RankProcs(tmp_path / f"run{run}")
            (tmp_path / f"run{run}").mkdir()
            try:
                t0 = time.monotonic()
                for rank in (1, 0):  # rank 0 comes late: rank 1 reads the store first
                    env = rank_env(rank, 2, port, TORCHELASTIC_USE_AGENT_STORE="True")
                    procs.start(rank, env, [*RUN_ARGS, "--join-timeout", "30"])
                    time.sleep(3.0)
                ended = procs.wait(60)
                took = max(e.at for e in ended.values()) - t0
            finally:
                procs.close()
            for e in ended.values():
                assert e.code == 0, f"run {run} rank {e.rank} rc {e.code}:\n{e.err[-2000:]}"
            assert took < 28, f"run {run} took {took:.1f} s: it waited out a join"
            assert "-> OK" in ended[0].out
    finally:
        del store


@pytest.mark.timeout(60)
@pytest.mark.parametrize("rank", [0, 1], ids=["waiting-for-peers", "waiting-for-store"])
def test_sigterm_while_joining_ends_the_rank_at_once(tmp_path: Path, rank: int) -> None:
    """Rank 0 hosts the store and waits for rank 1, which never comes; rank 1
    waits for a store nobody hosts. Either way SIGTERM ends it."""
    procs = RankProcs(tmp_path)
    try:
        procs.start(rank, rank_env(rank, 2, free_port()), [*RUN_ARGS, "--join-timeout", "60"])
        time.sleep(4.0)  # past import torch: the rank is joining by now
        assert procs.procs[rank].poll() is None, procs.text(rank, "err")
        t0 = time.monotonic()
        procs.procs[rank].send_signal(signal.SIGTERM)
        ended = procs.wait(10)[rank]
    finally:
        procs.close()
    assert ended.code == 1, ended.err
    assert ended.at - t0 < 3.0, f"exited {ended.at - t0:.1f} s after SIGTERM"
    assert "SIGTERM" in ended.err and "joining" in ended.err, ended.err


@pytest.mark.timeout(60)
def test_a_peer_that_never_arrives_is_named(tmp_path: Path) -> None:
    port = free_port()
    procs = RankProcs(tmp_path)
    try:
        for rank in (0, 1):  # rank 2 never starts
            procs.start(rank, rank_env(rank, 3, port),
                        ["--pp-size", "3", "--steps", "10", "--quiet", "--join-timeout", "6"])
        ended = procs.wait(40)
    finally:
        procs.close()
    for rank in (0, 1):
        e = ended[rank]
        assert e.code == 1, f"rank {rank} rc {e.code}:\n{e.err}"
        assert "could not join the world" in e.err, e.err
        assert "Traceback" not in e.err, e.err
    # rank 0 hosts the store: it names the absent rank (rank 1 names it too,
    # or says that the store's host gave up, whichever it sees first)
    assert "never arrived: rank 2" in ended[0].err, ended[0].err
