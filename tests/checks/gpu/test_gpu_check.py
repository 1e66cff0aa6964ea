"""``make gpu-check`` on a machine without CUDA: it says so and exits 2; and
a dry run of each check's rank code on CPU over gloo, so the script that a
GPU session runs once has had its logic exercised here. The table itself
(bounded fresh processes, rows flushed as they end, the run's budget):
tests/checks/gpu/test_gpu_table.py."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import ClassVar

import pytest
import torch

from ppsync.checks.gpu import check as gpu_check
from ppsync.checks.gpu import stream_checks
from ppsync.checks.gpu import workload_checks as workload
from ppsync.checks.gpu.step_costs import (
    format_timing,
    scheme_name,
    sync_guard_live,
    time_schemes,
    timing_verdict,
)
from ppsync.core.codec import check_frames
from ppsync.core.codec.device_kernels import triton_error
from ppsync.core.wire.completion import StreamOrdered
from ppsync.errors import ConfigError, RankFailed
from ppsync.harness.fresh import in_fresh_process
from ppsync.harness.launcher import spawn_ranks
from ppsync.schemas.config import SyncConfig

pytestmark = pytest.mark.skipif(torch.cuda.is_available(),
                                reason="the CPU dry run; on a GPU run make gpu-check")
ROOT = Path(__file__).resolve().parents[3]


def test_without_cuda_it_exits_2_and_says_why(capsys: pytest.CaptureFixture[str]) -> None:
    assert gpu_check.main([]) == 2
    assert "gpu-check: not run: no CUDA device" in capsys.readouterr().err


def _python(*args: str) -> subprocess.CompletedProcess[str]:
    """This Python, run plainly (as a CUDA image's would be) from the repository."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)


def test_run_as_a_module_it_exits_2_without_a_traceback() -> None:
    done = _python("-m", "ppsync.checks.gpu.check")
    assert done.returncode == 2, done.stderr
    assert "gpu-check: not run: no CUDA device" in done.stderr
    assert "Traceback" not in done.stderr and done.stdout == ""


def test_without_pydantic_import_says_what_to_install() -> None:
    hidden = "import sys; sys.modules['pydantic'] = None; "  # import pydantic fails then
    done = _python("-c", hidden + "import ppsync.checks.gpu.check")
    assert done.returncode == 1
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("ModuleNotFoundError: ppsync needs pydantic"), last
    assert "make gpu-wheels" in last and "--find-links wheels/gpu" in last


@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_dry_run_workload_is_exact_on_two_ranks(kernels: str) -> None:
    if kernels == "triton" and triton_error() is not None:
        pytest.skip(f"Triton cannot be loaded ({triton_error()}): install ppsync[triton]")
    res = spawn_ranks(functools.partial(workload.workload_rank, 60, "gloo", "warn", kernels),
                      2, timeout_s=workload.TIMEOUT_S)
    assert [r["exact"] for r in res] == [True, True]
    assert res[0]["report"]["rows_delivered"] > 0


def test_dry_run_per_step_timing_names_every_scheme() -> None:
    timing = in_fresh_process(time_schemes, 8, 2, 3, "cpu")
    sets = ["torch"] + (["triton"] if triton_error() is None else [])
    assert list(timing) == ["vllm gpu", *(scheme_name(k, c) for k in sets
                                          for c in ("host", "device"))]
    for roles in timing.values():
        assert set(roles) == {"last rank", "receiver"}
        assert all(host > 0 and dev == 0 for host, dev in roles.values())
    assert "ppsync device/torch/host carrier: last rank" in format_timing(timing)
    assert timing_verdict(timing, cuda=False)[0]
    assert not timing_verdict(timing, cuda=True)[0]  # no device time: events recorded nothing


def test_timing_verdict_fails_on_a_missing_role_or_scheme() -> None:
    both = {"last rank": (3.0, 1.0), "receiver": (3.0, 1.0)}
    host, device = scheme_name("torch", "host"), scheme_name("torch", "device")
    good = {"vllm gpu": {"last rank": (5.0, 1.0), "receiver": (5.0, 1.0)},
            host: both, device: both}
    assert timing_verdict(good, cuda=True) == (True, format_timing(good))
    assert not timing_verdict({"vllm gpu": good["vllm gpu"]}, cuda=True)[0]
    assert not timing_verdict({k: v for k, v in good.items() if k != device}, cuda=True)[0]
    one_role = {**good, host: {"last rank": (3.0, 1.0)}}
    assert not timing_verdict(one_role, cuda=True)[0]
    assert sync_guard_live(torch.device("cpu"))  # nothing to catch on CPU


def test_checks_over_nccl_name_the_device_carrier_and_over_gloo_the_default() -> None:
    nccl = StreamOrdered("nccl")
    assert stream_checks.carrier_over("nccl") == "device"
    assert stream_checks.carrier_over("gloo") == SyncConfig.model_fields["carrier"].default
    for config in (workload._config(2, "nccl"), stream_checks.device_config(2, "nccl")):
        check_frames(config, nccl, "nccl")  # the host carrier would be refused here:
    refused = workload._config(2, "gloo")
    with pytest.raises(ConfigError, match="carrier = 'host' sends frames over gloo"):
        check_frames(refused, nccl, "nccl")


def test_dry_run_one_rank_group_defers_the_bad_value() -> None:
    (res,) = spawn_ranks(functools.partial(workload.one_rank_rank, "gloo"), 1,
                         timeout_s=workload.TIMEOUT_S)
    assert res == {"ok": True, "detail": ""}


def test_dry_run_timing_and_late_peer() -> None:
    timed = spawn_ranks(functools.partial(workload.timed_rank, 5, "gloo"), 2,
                        timeout_s=workload.TIMEOUT_S)
    assert all(set(t) == {"fused frame", "raw broadcast", "vLLM's scheme"} for t in timed)
    late = spawn_ranks(functools.partial(workload.late_peer_rank, "gloo", 0.3), 2,
                       timeout_s=workload.TIMEOUT_S)
    assert late[0]["delivered"] is True
    assert 0 < late[0]["main_s"] <= late[0]["frame_s"]  # both from before post()


def test_late_peer_verdict_fails_when_held_undelivered_or_not_late() -> None:
    verdict = functools.partial(workload.late_peer_verdict, "sync", late_s=3.0)
    assert verdict({"main_s": 0.2, "frame_s": 3.1, "delivered": True})[0]
    assert not verdict({"main_s": 3.05, "frame_s": 3.1, "delivered": True})[0]  # held
    assert not verdict({"main_s": 0.2, "frame_s": 3.1, "delivered": False})[0]
    ok, detail = verdict({"main_s": 0.2, "frame_s": 0.3, "delivered": True})
    assert not ok and "premise false" in detail  # nothing was pending: it showed nothing


def test_dry_run_premise_reports_future_and_work() -> None:
    (res,) = spawn_ranks(functools.partial(stream_checks.premise_rank, "gloo"), 1,
                         timeout_s=workload.TIMEOUT_S)
    assert set(res) == {"future_done", "is_completed", "is_completed_after_sync"}
    assert res["is_completed_after_sync"] is True
    # gloo: the transfer ended with the call, so the premise is false there
    assert stream_checks.premise_verdict(res)[0] is (res["future_done"]
                                                    and not res["is_completed"])


def test_premise_verdict_asserts_the_premise() -> None:
    verdict = stream_checks.premise_verdict
    holds = {"future_done": True, "is_completed": False, "is_completed_after_sync": True}
    assert verdict(holds)[0] and "premise holds" in verdict(holds)[1]
    for key, value in (("future_done", False), ("is_completed", True),
                       ("is_completed_after_sync", False)):
        assert not verdict({**holds, key: value})[0], key
    assert "premise FALSE" in verdict({**holds, "is_completed": True})[1]


def test_dry_run_overwrite_after_publish_delivers_the_originals() -> None:
    res = spawn_ranks(functools.partial(stream_checks.overwrite_rank, "gloo", 12), 2,
                      timeout_s=workload.TIMEOUT_S)
    assert res == [{"wrong_steps": []}, {"wrong_steps": []}]


def test_dry_run_row_counts_drive_every_step() -> None:
    counts = in_fresh_process(stream_checks.variant_counts, "torch", "cpu", (1, 16, 17, 65))
    assert counts == [{}, {}, {}, {}]  # torch ops compile nothing; each n ran a step


def test_compiled_variants_reads_either_cache_layout_or_says_it_cannot() -> None:
    class NewTriton:  # Triton 3.2+: device -> (kernel cache, [key cache,] target, backend, ...)
        device_caches: ClassVar[dict[int, tuple[object, ...]]] = {
            0: ({"a": 1, "b": 2}, {}, None, None, None), 1: ({"c": 3}, None, None, None)}

    class OldTriton:  # before: device -> kernel cache
        cache: ClassVar[dict[int, dict[str, int]]] = {0: {"a": 1}}

    class OtherTriton:  # a layout this code does not know
        device_caches: ClassVar[dict[int, object]] = {0: object()}

    assert stream_checks.compiled_variants(NewTriton()) == 3
    assert stream_checks.compiled_variants(OldTriton()) == 1
    assert stream_checks.compiled_variants(OtherTriton()) is None
    assert stream_checks.compiled_variants(object()) is None


def test_variants_verdict_passes_flat_fails_growth_skips_unknown() -> None:
    verdict = functools.partial(stream_checks.variants_verdict, version="3.6.0")
    assert verdict([{"pack_frame": 2, "check_release": 1}] * 3)[0]
    assert not verdict([{"pack_frame": 2}, {"pack_frame": 3}])[0]
    assert not verdict([{"pack_frame": 0}, {"pack_frame": 0}])[0]  # nothing compiled: no check
    with pytest.raises(stream_checks.CheckSkipped, match=r"Triton 3\.6\.0: cannot count"):
        verdict([{"pack_frame": None}, {"pack_frame": None}])


def test_dry_run_kill_of_the_last_rank_is_named_by_every_survivor(tmp_path: Path) -> None:
    with contextlib.suppress(RankFailed):
        spawn_ranks(functools.partial(stream_checks.kill_rank, "gloo", 4.0, 10, str(tmp_path)),
                    3, timeout_s=20)
    seen = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(3)]
    assert "killed" in seen[2]
    for r in (0, 1):
        assert seen[r]["error"] == "PeerLost" and seen[r]["peer"] == 2, seen[r]
    ok, detail = stream_checks.kill_verdict(str(tmp_path), 3, 1e6)  # timings: GPU only
    assert ok, detail


def test_dry_run_late_peer_through_the_async_services() -> None:
    res = spawn_ranks(functools.partial(stream_checks.late_peer_async_rank, "gloo", 0.3), 2,
                      timeout_s=workload.TIMEOUT_S)
    assert res[0]["delivered"] is True and res[1] == {}
    assert 0 < res[0]["main_s"] <= res[0]["frame_s"]
