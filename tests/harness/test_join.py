"""Joining the world (``ppsync run``): scoped to one run, bounded, and
interruptible.

- Two runs, one after the other, against one long-lived store (torchrun's
  agent store, ``TORCHELASTIC_USE_AGENT_STORE=True``, kept by this test
  process): the second run does not read the first one's keys and both
  complete, well within the join timeout.
- A rank SIGTERMed while it waits for its peers (or for the store) ends
  within a second or so, exit code 1, with a line saying it was joining.
- A peer that never arrives is named when the join times out.
- Rank 0 hosting the store at an address that does not resolve, does not
  reach it, or a port in use: one line "could not join: ...", exit 2, within
  the join timeout.
- Waiting for the store's host prints no C++ stack trace.
- A stale arrival key (an earlier process of a rank arrived and died) lets a
  rank into torch's rendezvous: SIGTERM still ends it at once.
- A store kept after a run that lost a rank: every rank says what the store
  counts for the others and gives the --run-id hint, no raw store error.
"""

from __future__ import annotations

import datetime
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from rank_procs import RankProcs, free_port, rank_env
from torch._C._distributed_c10d import TCPStore

NOT_HERE = "203.0.113.7"  # TEST-NET-3: documentation only, never this host
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


def _past_import_torch(procs: RankProcs, rank: int) -> None:
    """Until the rank loaded torch and then sleeps nearly all the time (the
    join's waits; importing keeps it running): the SIGTERM handler is set."""
    deadline = time.monotonic() + 60
    pid = procs.procs[rank].pid
    while True:
        assert time.monotonic() < deadline, "the rank never settled into its join"
        assert procs.procs[rank].poll() is None, procs.text(rank, "err")
        if "libtorch_python" in Path(f"/proc/{pid}/maps").read_text(errors="replace"):
            states = []
            for _ in range(20):
                states.append(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0])
                time.sleep(0.05)
            if states.count("S") >= 19:
                break
        time.sleep(0.2)
    time.sleep(1.0)


@pytest.mark.timeout(90)
@pytest.mark.parametrize(("rank", "addr"), [(0, "127.0.0.1"), (1, "127.0.0.1"),
                                            (0, NOT_HERE)],
                         ids=["waiting-for-peers", "waiting-for-store", "hosting-unreachable"])
def test_sigterm_while_joining_ends_the_rank_at_once(tmp_path: Path, rank: int,
                                                     addr: str) -> None:
    """Rank 0 hosts the store and waits for rank 1, which never comes; rank 1
    waits for a store nobody hosts; rank 0 hosts the store at an address that
    is not this host's. Either way SIGTERM ends it."""
    procs = RankProcs(tmp_path)
    try:
        procs.start(rank, rank_env(rank, 2, free_port(), addr),
                    [*RUN_ARGS, "--join-timeout", "60"])
        _past_import_torch(procs, rank)
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


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", ["unresolvable", "unreachable", "port-in-use"])
def test_rank_0_that_cannot_host_the_store_says_so_in_one_line(tmp_path: Path,
                                                               case: str) -> None:
    busy = socket.socket()
    busy.bind(("0.0.0.0", 0))
    busy.listen()
    addr = {"unresolvable": "nonexistent.invalid", "unreachable": NOT_HERE}.get(case,
                                                                                "127.0.0.1")
    port = busy.getsockname()[1] if case == "port-in-use" else free_port()
    procs = RankProcs(tmp_path)
    try:
        procs.start(0, rank_env(0, 2, port, addr), [*RUN_ARGS, "--join-timeout", "5"])
        ended = procs.wait(40)[0]
    finally:
        procs.close()
        busy.close()
    assert ended.code == 2, ended.err
    lines = ended.err.strip().splitlines()
    assert len(lines) == 1 and "rank 0 of 2 could not join: " in lines[0], ended.err


@pytest.mark.timeout(60)
def test_waiting_for_the_store_host_prints_no_cpp_stack_trace(tmp_path: Path) -> None:
    procs = RankProcs(tmp_path)
    try:
        procs.start(1, rank_env(1, 2, free_port()), [*RUN_ARGS, "--join-timeout", "4"])
        ended = procs.wait(40)[1]
    finally:
        procs.close()
    assert ended.code == 1, ended.err
    assert "frame #" not in ended.err and "Exception raised from" not in ended.err, ended.err
    assert "no store answered" in ended.err, ended.err
    assert len(ended.err.strip().splitlines()) <= 2, ended.err


@pytest.fixture
def kept_store() -> Iterator[int]:
    """A store that outlives the runs (torchrun's agent store): its port."""
    port = free_port()
    store = TCPStore("127.0.0.1", port, 3, is_master=True, wait_for_workers=False,
                     timeout=datetime.timedelta(seconds=60))
    try:
        yield port
    finally:
        del store


def _lone_rank(tmp: Path, port: int, rank: int) -> str:
    """A run on the kept store in which only ``rank`` ever starts: it counts
    a run, posts its arrival and gives up; its stderr."""
    procs = RankProcs(tmp)
    tmp.mkdir()
    try:
        procs.start(rank, rank_env(rank, 2, port, TORCHELASTIC_USE_AGENT_STORE="True"),
                    [*RUN_ARGS, "--join-timeout", "3"])
        ended = procs.wait(40)[rank]
    finally:
        procs.close()
    assert ended.code == 1, ended.err
    return ended.err


@pytest.mark.timeout(90)
def test_sigterm_inside_the_rendezvous_after_a_stale_arrival(tmp_path: Path,
                                                            kept_store: int) -> None:
    _lone_rank(tmp_path / "earlier", kept_store, 1)  # arrived in run 1, then gone
    procs = RankProcs(tmp_path)
    store = TCPStore("127.0.0.1", kept_store, is_master=False,
                     timeout=datetime.timedelta(seconds=10))
    try:
        procs.start(0, rank_env(0, 2, kept_store, TORCHELASTIC_USE_AGENT_STORE="True"),
                    [*RUN_ARGS, "--join-timeout", "60"])
        deadline = time.monotonic() + 40
        while not store.check(["ppsync/runs/attempt_0/run_1/arrived/0"]):
            assert time.monotonic() < deadline and procs.procs[0].poll() is None
            time.sleep(0.1)
        time.sleep(1.5)  # rank 1's stale key passed the check: in init_process_group
        assert procs.procs[0].poll() is None, procs.text(0, "err")
        t0 = time.monotonic()
        procs.procs[0].send_signal(signal.SIGTERM)
        ended = procs.wait(10)[0]
    finally:
        procs.close()
    assert ended.code == 1, ended.err
    assert ended.at - t0 < 3.0, f"exited {ended.at - t0:.1f} s after SIGTERM"
    assert "SIGTERM" in ended.err and "joining" in ended.err, ended.err


@pytest.mark.timeout(120)
def test_a_store_kept_after_a_lost_rank_gives_every_rank_the_run_id_hint(
    tmp_path: Path, kept_store: int
) -> None:
    _lone_rank(tmp_path / "earlier", kept_store, 0)  # run 1 lost rank 1 before it joined
    procs = RankProcs(tmp_path)
    try:
        for rank in (0, 1):  # now rank 0 counts run 2, rank 1 run 1
            procs.start(rank, rank_env(rank, 2, kept_store, TORCHELASTIC_USE_AGENT_STORE="True"),
                        [*RUN_ARGS, "--join-timeout", "8"])
            time.sleep(2.0)
        ended = procs.wait(60)
    finally:
        procs.close()
    for rank, other, run in ((0, 1, 1), (1, 0, 2)):
        e = ended[rank]
        assert e.code == 1, f"rank {rank} rc {e.code}:\n{e.err}"
        assert "Traceback" not in e.err and "keys:" not in e.err, e.err
        assert f"rank {other} in run {run}" in e.err and "--run-id" in e.err, e.err
    assert "never arrived: rank 1" in ended[0].err, ended[0].err
