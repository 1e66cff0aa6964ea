"""``make gpu-check`` on a machine without CUDA: it says so and exits 2; and
a dry run of each check's rank code on CPU over gloo, so the script that a
GPU session runs once has had its logic exercised here."""

from __future__ import annotations

import contextlib
import functools
import json
from pathlib import Path
from typing import ClassVar

import pytest
import torch

from ppsync.bench import gpu_check
from ppsync.bench import gpu_stream_checks as stream_checks
from ppsync.bench.fresh import in_fresh_process
from ppsync.bench.gpu_steps import format_timing, time_schemes
from ppsync.core.device_kernels import triton_error
from ppsync.errors import RankFailed
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
    assert list(timing) == ["vllm gpu", *(f"ppsync device/{k}" for k in sets)]
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
    assert all(set(t) == {"fused frame", "raw broadcast", "vLLM's scheme"} for t in timed)
    late = spawn_ranks(functools.partial(gpu_check._late_peer_rank, "gloo", 0.3), 2,
                       timeout_s=gpu_check.TIMEOUT_S)
    assert late[0]["delivered"] is True


def test_dry_run_premise_reports_future_and_work() -> None:
    (res,) = spawn_ranks(functools.partial(stream_checks.premise_rank, "gloo"), 1,
                         timeout_s=gpu_check.TIMEOUT_S)
    assert set(res) == {"future_done", "is_completed", "is_completed_after_sync"}
    assert res["is_completed_after_sync"] is True


def test_dry_run_overwrite_after_publish_delivers_the_originals() -> None:
    res = spawn_ranks(functools.partial(stream_checks.overwrite_rank, "gloo", 12), 2,
                      timeout_s=gpu_check.TIMEOUT_S)
    assert res == [{"wrong_steps": []}, {"wrong_steps": []}]


def test_dry_run_row_counts_drive_every_step() -> None:
    counts = in_fresh_process(stream_checks.variant_counts, "torch", "cpu", (1, 16, 17, 65))
    assert counts == [{}, {}, {}, {}]  # torch ops compile nothing; each n ran a step


def test_compiled_variants_reads_either_cache_layout() -> None:
    class NewTriton:  # Triton 3.2+: device -> (kernel cache, [key cache,] target, backend, ...)
        device_caches: ClassVar[dict[int, tuple[object, ...]]] = {
            0: ({"a": 1, "b": 2}, {}, None, None, None), 1: ({"c": 3}, None, None, None)}

    class OldTriton:  # before: device -> kernel cache
        cache: ClassVar[dict[int, dict[str, int]]] = {0: {"a": 1}}

    assert stream_checks.compiled_variants(NewTriton()) == 3
    assert stream_checks.compiled_variants(OldTriton()) == 1


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
                      timeout_s=gpu_check.TIMEOUT_S)
    assert res[0]["delivered"] is True and res[1] == {}
