"""``make gpu-check``'s host-carrier checks (n-p) on CPU: the one rank
function's parts on real gloo ranks running the CPU twin of a device with
the host carrier (stand-in streams whose copies end late, so sends are
deferred as on a GPU), and each verdict on what a GPU would return; the
table's new rows and the summary's carrier line."""

from __future__ import annotations

import copy
import functools
from typing import Any

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from ppsync.checks.gpu import carrier_checks as carrier
from ppsync.checks.gpu import check as gpu_check
from ppsync.harness.launcher import spawn_ranks

pytestmark = pytest.mark.skipif(torch.cuda.is_available(),
                                reason="the CPU dry run; on a GPU run make gpu-check")
LAG_S = 0.002


@pytest.mark.parametrize("P", [2, 3])
def test_dry_run_workload_through_the_host_carrier_is_exact_and_never_waits_on_a_copy(
        P: int) -> None:
    plan = carrier.Plan(steps=80, twin_lag_s=LAG_S)
    res = spawn_ranks(functools.partial(carrier.carrier_rank, plan), P,
                      timeout_s=carrier.TIMEOUT_S)
    assert [r["rank"] for r in res] == list(range(P)) and res[-1]["last"]
    for r in res:
        assert [w["k"] for w in r["workload"]] == [0, 3]
        for w in r["workload"]:
            assert w["exact"] and w["syncs"] == []
            assert w["copies"]["built"] == 1  # one path per K, each a host carrier
            assert (w["copies"]["copy_waits"], w["copies"]["reused_early"]) == (0, 0)
            assert (w["rows"] if not r["last"] else w["sent"]) > 0
    # the premise: the twin's late copies deferred the last rank's sends to a later pump
    assert all(w["copies"]["deferred"] > 0 for w in res[-1]["workload"])
    ok, detail = carrier.workload_verdict({P: res}, 80)
    assert ok, detail
    assert f"P={P} K=0: " in detail and f"P={P} K=3: " in detail
    assert "0 on every rank" in detail


def _workload(**change: Any) -> dict[str, Any]:
    good: dict[str, Any] = {"k": 3, "exact": True, "rows": 100, "sent": 0, "syncs": [],
                            "copies": {"copy_waits": 0, "reused_early": 0, "built": 1,
                                       "deferred": 4}}
    copies = {k: change.pop(k) for k in list(change) if k in good["copies"]}
    good["copies"].update(copies)
    return {**good, **change}


def test_workload_verdict_names_each_fault_and_its_rank() -> None:
    def runs(bad: dict[str, Any]) -> dict[int, list[dict[str, Any]]]:
        return {2: [{"rank": 0, "workload": [_workload()]},
                    {"rank": 1, "workload": [bad]}]}

    assert carrier.workload_verdict(runs(_workload()), 10)[0]
    for change, said in (({"exact": False}, "rank 1: not exact"),
                         ({"built": 0}, "no host carrier built"),
                         ({"copy_waits": 2}, "2 copy waits"),
                         ({"reused_early": 1}, "1 pinned buffers reused early"),
                         ({"syncs": ["called a synchronizing CUDA operation"]},
                          "synchronizing calls")):
        ok, detail = carrier.workload_verdict(runs(_workload(**change)), 10)
        assert not ok and said in detail, (change, detail)


def test_dry_run_profile_and_matmul_parts_on_the_twin() -> None:
    plan = carrier.Plan(profile_steps=8, pairs=3, block_steps=4, twin_lag_s=LAG_S)
    res = spawn_ranks(functools.partial(carrier.carrier_rank, plan), 2,
                      timeout_s=carrier.TIMEOUT_S)
    for r in res:
        assert "workload" not in r
        seen = r["profile"]
        assert (seen["kernels"], seen["copies"], seen["nccl"], seen["steps"]) == (0, 0, 0, 8)
        blocks = r["ratio"]
        assert len(blocks["with_s"]) == len(blocks["without_s"]) == 3
        assert all(t > 0 for t in blocks["with_s"] + blocks["without_s"])
        assert blocks["copies"]["built"] == 1 and blocks["copies"]["reused_early"] == 0
    assert res[0]["ratio"]["released"] > 0  # the receiver got frames in the blocks with the path
    ok, detail = carrier.profile_verdict(res)
    assert not ok and detail.startswith("premise FALSE")  # CPU: no device kernel to see
    _, detail = carrier.ratio_verdict({2: res})  # the figures: meaningless on 2 shared cores
    assert "P=2 (" in detail and "rank 0 " in detail and "rank 1 " in detail


def test_device_activity_counts_kernels_and_copies_and_finds_nccl() -> None:
    events = [("ampere_sgemm_128x64_nn", True), ("Memcpy DtoH (Device -> Pinned)", True),
              ("Memset (Device)", True), ("aten::mm", False), ("nccl:broadcast", False),
              ("ncclDevKernel_Broadcast_RING_LL(ncclDevKernelArgsStorage<4096ul>)", True)]
    seen = carrier.device_activity(events)
    assert (seen["kernels"], seen["copies"], seen["nccl"]) == (2, 2, 1)
    assert seen["nccl_names"] == [events[-1][0]]
    # a real (CPU-only) profile: nothing ran on a device
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        torch.mm(torch.ones(8, 8), torch.ones(8, 8))
    cpu = carrier.device_activity((e.name, e.device_type.name == "CUDA")
                                  for e in prof.events())
    assert (cpu["kernels"], cpu["copies"], cpu["nccl"]) == (0, 0, 0)


def test_profile_verdict_fails_on_an_nccl_kernel_or_an_empty_trace() -> None:
    clean = {"kernels": 40, "copies": 12, "nccl": 0, "nccl_names": [], "steps": 50}
    ranks = [{"rank": 0, "profile": clean}, {"rank": 1, "profile": clean}]
    ok, detail = carrier.profile_verdict(ranks)
    assert ok and "rank 1: 40 kernels, 12 copies, 0 NCCL" in detail
    nccl = {**clean, "nccl": 1, "nccl_names": ["ncclDevKernel_Broadcast"]}
    ok, detail = carrier.profile_verdict([ranks[0], {"rank": 1, "profile": nccl}])
    assert not ok and "1 NCCL ['ncclDevKernel_Broadcast']" in detail
    ok, detail = carrier.profile_verdict([ranks[0], {"rank": 1, "profile": {**clean,
                                                                             "kernels": 0}}])
    assert not ok and detail.startswith("premise FALSE")


def test_paired_ratio_is_the_median_of_pairs_and_the_verdict_holds_every_rank() -> None:
    assert carrier.paired_ratio([1.01, 1.0, 5.0], [1.0, 1.0, 1.0]) == pytest.approx(1.01)
    with pytest.raises(ValueError, match="shorter"):
        carrier.paired_ratio([1.0, 1.0], [1.0])

    def rank(r: int, ratio: float, released: int = 5) -> dict[str, Any]:
        return {"rank": r, "last": r == 2, "ratio": {
            "with_s": [ratio, ratio], "without_s": [1.0, 1.0], "released": released,
            "step_ms": 3.0, "copies": {"copy_waits": 0}}}

    ok, detail = carrier.ratio_verdict({3: [rank(0, 1.01), rank(1, 1.0), rank(2, 1.015)]})
    assert ok and "P=3 (3.0 ms/step, 0 copy waits): rank 0 1.010x" in detail
    assert not carrier.ratio_verdict({3: [rank(0, 1.01), rank(1, 1.03), rank(2, 1.0)]})[0]
    ok, detail = carrier.ratio_verdict({2: [rank(0, 1.0, released=0), rank(2, 1.0)]})
    assert not ok and "rank 0 1.000x (no frame)" in detail


def test_the_table_lists_n_o_p_bounded_within_the_budget() -> None:
    table = gpu_check.checks(steps=10, gpus=1, carrier_steps=123)
    new = [c for c in table if c.name[0] in "nop"]
    assert [c.name[:2] for c in new] == ["n)", "o)", "p)"] and not any(c.skip for c in new)
    assert all(c.bound_s <= 75 for c in new)
    assert sum(c.bound_s for c in new) <= gpu_check.RUN_BUDGET_S * 2 / 3
    n = new[0].run
    assert isinstance(n, functools.partial) and n.args == (123,)
    assert "host carrier" in new[1].name and f"{carrier.RATIO_LIMIT:.2f}x" in new[2].name


def test_the_carrier_line_follows_n_o_p() -> None:
    rows = [("a) x", "PASS", "", 1.0), ("n) x", "PASS", "", 1.0), ("o) x", "PASS", "", 1.0),
            ("p) x", "PASS", "", 1.0)]
    line = carrier.carrier_line(rows)
    assert line.startswith("carrier: the host carrier stays the default (n, o, p passed) "
                           "unless a GPU run shows ")
    assert all(f"{what} ({k})" in line for k, what in carrier.SHOWS.items())
    failed = copy.copy(rows)
    failed[3] = ("p) x", "FAIL", "", 1.0)
    line = carrier.carrier_line(failed)
    assert line.startswith(f"carrier: p failed: {carrier.SHOWS['p']}: this run is evidence "
                           "against the host carrier")
    line = carrier.carrier_line([*rows[:2], ("o) x", "SKIP", "", 0.0)])
    assert line.startswith("carrier: o, p not run: this run neither confirms nor changes")
    assert carrier.carrier_line(rows) in gpu_check.summary(rows, 1.0, 330, gpus=0)
