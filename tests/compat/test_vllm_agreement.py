"""Settings that reach every worker, or a refusal (ppsync.compat.vllm.agreement),
between real processes on a real TCPStore (vLLM's PP group's store plays
that part in an engine); and the Ray executor's copy rule
(ppsync.compat.vllm.ray_env) against a stand-in of vLLM 0.32's."""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import os
import re
import time
from datetime import timedelta

import pytest
from rank_procs import free_port
from torch._C._distributed_c10d import TCPStore

from ppsync.compat.vllm import plugin
from ppsync.compat.vllm.agreement import Peers, RankFacts, agree, differences, facts_here
from ppsync.compat.vllm.ray_env import (
    PREFIX,
    RAY_PREFIXES_ENV,
    copied_by_ray,
    ensure_ray_copies,
    with_prefix,
)
from ppsync.compat.vllm.settings import PluginSettings
from ppsync.errors import ConfigError

RANKS = [0, 1]


def _facts(rank: int, **settings: object) -> RankFacts:
    chosen = dataclasses.replace(PluginSettings(), **settings)  # type: ignore[arg-type]
    return facts_here(chosen, global_rank=rank, pp_rank=rank, interface="0.32",
                      version="0.1.0")


def _rank(rank: int, port: int, settings: dict[str, object], timeout_s: float,
          out: mp.Queue[tuple[int, str, float]]) -> None:
    store = TCPStore("127.0.0.1", port, 2, rank == 0, timedelta(seconds=30))
    t0 = time.monotonic()
    try:
        peers = agree(store, _facts(rank, **settings), RANKS, timeout_s=timeout_s)
        said = f"agreed: {peers.who(1 - rank)}"
    except ConfigError as e:
        said = str(e)
    out.put((rank, said, time.monotonic() - t0))
    time.sleep(0.5)  # rank 0 hosts the store: let rank 1 finish reading it


def _run(settings: tuple[dict[str, object], dict[str, object] | None],
         timeout_s: float = 5.0) -> dict[int, tuple[str, float]]:
    """Both ranks in real processes (``None``: rank 1 never announces, as a
    worker on vLLM's own handler)."""
    ctx = mp.get_context("spawn")
    out: mp.Queue[tuple[int, str, float]] = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(0, port, settings[0], timeout_s, out))]
    if settings[1] is not None:
        procs.append(ctx.Process(target=_rank, args=(1, port, settings[1], timeout_s, out)))
    else:  # a rank that joins the store but runs no ppsync
        procs.append(ctx.Process(target=_silent_rank, args=(port,)))
    for p in procs:
        p.start()
    got = {}
    try:
        for _ in range(sum(s is not None for s in settings)):
            rank, said, seconds = out.get(timeout=timeout_s + 60)
            got[rank] = (said, seconds)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return got


def _silent_rank(port: int) -> None:
    TCPStore("127.0.0.1", port, 2, False, timedelta(seconds=30))
    time.sleep(8)


@pytest.mark.timeout(120)
def test_ranks_with_the_same_settings_agree_and_know_each_others_host() -> None:
    got = _run(({}, {}))
    for rank in RANKS:
        assert re.match(rf"agreed: PP rank {1 - rank} \(global rank {1 - rank}, host .+, pid "
                        r"\d+\)$", got[rank][0]), got


@pytest.mark.timeout(120)
def test_a_different_timeout_is_refused_on_both_ranks_in_one_line_naming_the_other() -> None:
    got = _run(({"timeout_s": 20.0}, {"timeout_s": 30.0}))
    for rank in RANKS:
        line, seconds = got[rank]
        assert "\n" not in line and seconds < 5, got
        assert line.startswith(f"ppsync: PP rank {rank} (global rank {rank}, host "), line
        assert f"refuses to serve: PP rank {1 - rank} (global rank {1 - rank}, host " in line
        mine, theirs = ("20", "30") if rank == 0 else ("30", "20")
        assert f"PPSYNC_TIMEOUT_S {mine} here, {theirs} there" in line, line


@pytest.mark.timeout(120)
def test_a_rank_that_never_announces_is_refused_within_the_bound() -> None:
    got = _run(({}, None), timeout_s=2.0)
    line, seconds = got[0]
    assert 2.0 <= seconds < 4.0, got
    assert re.match(r"ppsync: PP rank 0 \(global rank 0, host .+\) refuses to serve: PP rank 1 "
                    r"\(global rank 1\) did not announce ppsync's settings within "
                    r"PPSYNC_TIMEOUT_S = 2 s: it runs vLLM's own PPHandler", line), line


def test_differences_name_each_setting_by_its_variable() -> None:
    a = _facts(0, codec="host")
    b = dataclasses.replace(_facts(1, codec="device", on_error="raise"), interface="0.33")
    assert differences(a, b) == ["vLLM interface 0.32 here, 0.33 there",
                                 "PPSYNC_CODEC host here, device there",
                                 "PPSYNC_VLLM_ON_ERROR exit here, raise there"]
    assert differences(a, dataclasses.replace(a, global_rank=1, host="elsewhere")) == []
    assert Peers({1: b}).who(1) == b.who() and Peers({}).who(1) is None


def test_the_ray_copy_rule_drops_ppsync_variables_unless_the_prefix_is_added() -> None:
    env = {"PPSYNC_VLLM": "1", "PPSYNC_TIMEOUT_S": "30", "VLLM_HOST_IP": "10.0.0.1",
           "NCCL_DEBUG": "INFO", "OTHER": "x"}
    assert copied_by_ray(env) == {"VLLM_HOST_IP", "NCCL_DEBUG"}  # vLLM 0.32's defaults
    assert ensure_ray_copies(env) is True
    assert env[RAY_PREFIXES_ENV] == PREFIX
    assert copied_by_ray(env) == {"VLLM_HOST_IP", "NCCL_DEBUG", "PPSYNC_VLLM",
                                  "PPSYNC_TIMEOUT_S", RAY_PREFIXES_ENV}
    assert ensure_ray_copies(env) is False  # once is enough
    env[RAY_PREFIXES_ENV] = " MYLIB_ , "
    assert ensure_ray_copies(env) is True and env[RAY_PREFIXES_ENV] == " MYLIB_ , ,PPSYNC_"
    assert "PPSYNC_VLLM" in copied_by_ray(env)
    assert with_prefix("PP") is None and with_prefix("PPSYNC_VLLM") == "PPSYNC_VLLM,PPSYNC_"


def test_the_plugin_adds_the_prefix_when_switched_on_before_it_binds(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(RAY_PREFIXES_ENV, raising=False)
    monkeypatch.delenv(plugin.ENV_SWITCH, raising=False)
    plugin.register()  # off: nothing
    assert RAY_PREFIXES_ENV not in os.environ
    monkeypatch.setenv(plugin.ENV_SWITCH, "1")
    monkeypatch.setenv("PPSYNC_VLLM_INTERFACE", "0.32")
    with pytest.raises(ConfigError, match="cannot be imported"):  # no vLLM here
        plugin.register()
    assert os.environ[RAY_PREFIXES_ENV] == PREFIX
