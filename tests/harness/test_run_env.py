"""``ppsync run``: one rank per process from torchrun's environment.

Bad environment exits 2 naming the variable, before anything connects. Three
real processes under plain env:// (rank 0 hosts the store) print one table
and exit 0. A rank killed mid-run makes every survivor exit 1 within
timeout + 5 s: named by the failure board when the store survives, and still
typed and bounded when the killed rank was the store's host.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from rank_procs import RankProcs, free_port, rank_env

from ppsync.cli import main

TIMEOUT_S = 5.0  # --timeout of every rank; survivors must end within TIMEOUT_S + 5 s
ARGS = ["--max-num-reqs", "8", "--spec", "1", "--timeout", str(TIMEOUT_S)]
GOOD = {"RANK": "1", "WORLD_SIZE": "3", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29500"}


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"RANK": None}, r"environment variable RANK is not set"),
        ({"WORLD_SIZE": "three"}, r"WORLD_SIZE = 'three' must be an integer"),
        ({"WORLD_SIZE": "0"}, r"WORLD_SIZE = 0 must be >= 1"),
        ({"RANK": "3"}, r"RANK = 3 must be in \[0, WORLD_SIZE - 1 = 2\]"),
        ({"LOCAL_RANK": "-1"}, r"LOCAL_RANK = -1 must be >= 0"),
        ({"MASTER_ADDR": None}, r"environment variable MASTER_ADDR is not set"),
        ({"MASTER_PORT": "70000"}, r"MASTER_PORT = 70000 must be in \[1, 65535\]"),
        ({"MASTER_PORT": ""}, r"environment variable MASTER_PORT is not set"),
    ],
    ids=["rank-missing", "world-not-int", "world-zero", "rank-too-big", "local-negative",
         "addr-missing", "port-too-big", "port-empty"],
)
def test_bad_environment_exits_2_naming_the_variable(
    change: dict[str, str | None], message: str,
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    for name, value in {**GOOD, **change}.items():
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    assert main(["run", "--steps", "5"]) == 2
    err = capsys.readouterr().err
    assert re.search(message, err), err


def test_world_not_a_multiple_of_pp_size_exits_2(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for name, value in GOOD.items():
        monkeypatch.setenv(name, value)
    assert main(["run", "--steps", "5", "--pp-size", "2"]) == 2
    assert re.search(r"pp_size = 2 must divide world_size = 3", capsys.readouterr().err)


@pytest.fixture
def ranks(tmp_path: Path) -> Iterator[RankProcs]:
    procs = RankProcs(tmp_path)
    try:
        yield procs
    finally:
        procs.close()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--device", "cuda"], r"--device cuda needs --codec device"),
        pytest.param(["--device", "cuda", "--codec", "device"],
                     r"--device cuda: no cuda device is available here",
                     marks=pytest.mark.skipif(torch.cuda.is_available(), reason="has CUDA")),
    ],
    ids=["host-codec", "no-cuda"],
)
def test_device_needs_the_device_codec_and_a_device(
    argv: list[str], message: str,
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    for name, value in GOOD.items():
        monkeypatch.setenv(name, value)
    assert main(["run", "--steps", "5", *argv]) == 2  # before anything connects
    assert re.search(message, capsys.readouterr().err)


@pytest.mark.parametrize("codec", ["host", "device"])
def test_three_env_ranks_print_one_table_and_exit_0(
    ranks: RankProcs, tmp_path: Path, codec: str
) -> None:
    port = free_port()
    report = tmp_path / "report.json"
    for r in range(3):
        ranks.start(r, rank_env(r, 3, port),
                    ["--steps", "150", "--report", str(report), "--quiet", "--codec", codec,
                     *ARGS])
    ended = ranks.wait(90)
    assert [ended[r].code for r in range(3)] == [0, 0, 0], [ended[r].err for r in range(3)]
    table = ended[0].out.strip().splitlines()
    assert [line.split()[:3] for line in table[1:4]] == [
        ["0", "0", "receiver"], ["1", "0", "receiver"], ["2", "0", "last"]]
    assert re.search(rf"world=3 pp_size=3 .* codec={codec} .* -> OK: 0 lost / 0 stale",
                     table[4])
    assert ended[1].out == ended[2].out == ""  # one table, from rank 0
    assert all("ppsync: step" not in ended[r].err for r in range(3))  # --quiet
    assert '"world_size": 3' in report.read_text()


def _kill_mid_run(ranks: RankProcs, victim: int) -> tuple[float, dict[int, int | None],
                                                          dict[int, float], dict[int, str]]:
    port = free_port()
    for r in range(3):
        ranks.start(r, rank_env(r, 3, port),
                    ["--steps", "1000000", "--progress-every", "0.2", *ARGS])
    watched = 0 if victim != 0 else 1
    if victim == 0:
        ranks.wait_for_progress(0, 60)
    else:
        ranks.wait_for_progress(watched, 60)
    killed_at = ranks.kill(victim)
    ended = ranks.wait(TIMEOUT_S + 5 + 10)  # a hang shows as code None
    survivors = [r for r in range(3) if r != victim]
    return (killed_at, {r: ended[r].code for r in survivors},
            {r: ended[r].at - killed_at for r in survivors},
            {r: ended[r].err for r in survivors})


@pytest.mark.timeout(180)
def test_a_killed_rank_is_named_by_every_survivor(ranks: RankProcs) -> None:
    _, codes, took, errs = _kill_mid_run(ranks, victim=1)
    assert codes == {0: 1, 2: 1}, errs
    for r, err in errs.items():
        assert took[r] <= TIMEOUT_S + 5, (r, took[r], err)
        assert re.search(rf"ppsync: rank {r}: PeerLost: lost peer rank\(s\) 1 \(global\)",
                         err), err


@pytest.mark.timeout(180)
def test_when_the_store_host_dies_survivors_fail_typed_and_bounded(ranks: RankProcs) -> None:
    # plain env://: rank 0's process hosts the store, so the failure board dies
    # with it; survivors cannot name it, but still end typed within the bound
    _, codes, took, errs = _kill_mid_run(ranks, victim=0)
    assert codes == {1: 1, 2: 1}, errs
    for r, err in errs.items():
        assert took[r] <= TIMEOUT_S + 5, (r, took[r], err)
        assert re.search(rf"ppsync: rank {r}: (PeerLost|SyncTimeout): ", err), err


def test_a_rank_whose_peers_never_come_fails_typed_after_the_join_timeout(
    ranks: RankProcs,
) -> None:
    ranks.start(0, rank_env(0, 2, free_port()), ["--steps", "5", "--join-timeout", "2",
                                                 "--quiet", *ARGS])
    ended = ranks.wait(60)
    assert ended[0].code == 1, ended[0].err
    assert re.search(r"ppsync: rank 0: SyncTimeout: rank 0 of 2 could not join the world at "
                     r"127\.0\.0\.1:\d+ within join timeout = 2\.0 s", ended[0].err), ended[0].err
