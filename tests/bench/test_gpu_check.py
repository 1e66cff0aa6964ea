"""``make gpu-check`` on a machine without CUDA: it says so and exits 2; and
a dry run of each check's rank code on CPU over gloo, so the script that a
GPU session runs once has had its logic exercised here."""

from __future__ import annotations

import functools

import pytest
import torch

from ppsync.bench import gpu_check
from ppsync.bench.codec_cpu import in_fresh_process
from ppsync.bench.gpu_steps import format_timing, time_schemes
from ppsync.core.device_kernels import triton_error
from ppsync.harness.launcher import spawn_ranks

pytestmark = pytest.mark.skipif(torch.cuda.is_available(),
                                reason="the CPU dry run; on a GPU run make gpu-check")


def test_without_cuda_it_exits_2_and_says_why(capsys: pytest.CaptureFixture[str]) -> None:
    assert gpu_check.main([]) == 2
    assert "gpu-check: not run: no CUDA device" in capsys.readouterr().err


@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_dry_run_workload_is_exact_on_two_ranks(kernels: str) -> None:
    if kernels == "triton" and triton_error() is not None:
        pytest.skip(f"Triton cannot be loaded ({triton_error()}): install ppsync[triton]")
    res = spawn_ranks(functools.partial(gpu_check._workload_rank, 60, "gloo", "warn", kernels),
                      2, timeout_s=gpu_check.TIMEOUT_S)
    assert [r["exact"] for r in res] == [True, True]
    assert res[0]["report"]["rows_delivered"] > 0


def test_dry_run_per_step_timing_names_every_scheme() -> None:
    timing = in_fresh_process(time_schemes, 8, 2, 3, "cpu")
    sets = ["torch"] + (["triton"] if triton_error() is None else [])
    assert list(timing) == ["vllm gpu (seeds)", *(f"ppsync device/{k}" for k in sets)]
    for roles in timing.values():
        assert set(roles) == {"last rank", "receiver"}
        assert all(host > 0 and dev == 0 for host, dev in roles.values())
    assert "ppsync device/torch: last rank" in format_timing(timing)


def test_dry_run_one_rank_group_defers_the_bad_value() -> None:
    (res,) = spawn_ranks(functools.partial(gpu_check._one_rank_nccl, "gloo"), 1,
                         timeout_s=gpu_check.TIMEOUT_S)
    assert res == {"ok": True, "detail": ""}


def test_dry_run_timing_and_late_peer() -> None:
    timed = spawn_ranks(functools.partial(gpu_check._timed_rank, 5, "gloo"), 2,
                        timeout_s=gpu_check.TIMEOUT_S)
    assert all(set(t) == {"fused frame", "raw broadcast", "seeds' scheme"} for t in timed)
    late = spawn_ranks(functools.partial(gpu_check._late_peer_rank, "gloo", 0.3), 2,
                       timeout_s=gpu_check.TIMEOUT_S)
    assert late[0]["delivered"] is True
