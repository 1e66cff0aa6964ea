"""``make gpu-check``'s one-GPU checks of NCCL's failure path (j-m), on CPU:
each probe's dry run over a one-rank gloo group judged by ppsync's
stream-ordered completion (nothing stays pending there, so the verdicts
that need a pending work say their premise is false), each verdict on the
observations a GPU would give, and m's logic with stand-ins for a pending
work and a capture."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

from ppsync.checks.gpu import capture_check as capture
from ppsync.checks.gpu import failure_checks as failure
from ppsync.core.wire.completion import StreamOrdered
from ppsync.core.wire.platform import Platform
from ppsync.harness.fresh import in_fresh_process

pytestmark = pytest.mark.skipif(torch.cuda.is_available(),
                                reason="the CPU dry run; on a GPU run make gpu-check")


def test_dry_run_exception_probe_ppsync_never_calls_it() -> None:
    res = in_fresh_process(failure.exception_probe, "gloo", timeout_s=120)
    assert res["ppsync_calls"] == 0 and res["steps"] > 0
    assert (res["ended"], res["ended_well"], res["failure"]) == (True, True, "None")
    assert res["exception"].startswith(("returned", "raised"))  # what this torch does
    ok, detail = failure.exception_verdict(res)
    assert ok and f"torch {torch.__version__}: work.exception() " in detail


def test_exception_verdict_fails_when_ppsync_calls_it_or_misreads_the_work() -> None:
    seen = {"torch": "2.11.0+cu130", "completed": True, "ended": True, "ended_well": True,
            "failure": "None", "ppsync_calls": 0, "steps": 8, "carrier": "device",
            "exception": "raised TypeError: Unable to convert function return value"}
    assert failure.exception_verdict(seen)[0]
    assert not failure.exception_verdict({**seen, "ppsync_calls": 1})[0]
    assert not failure.exception_verdict({**seen, "ended_well": False})[0]
    assert not failure.exception_verdict({**seen, "failure": "RuntimeError('x')"})[0]


def test_counting_calls_counts_each_call_once_and_restores() -> None:
    class Base:
        def exception(self) -> str:
            return "base"

    class Work(Base):
        pass

    calls: list[str] = []
    with failure.counting_calls([Base, Work], "exception", calls):
        assert Work().exception() == "base"
        assert Base().exception() == "base"
    assert calls == ["exception"] * 2
    assert "exception" not in Work.__dict__ and Work().exception() == "base"
    assert len(calls) == 2


def test_dry_run_abort_probe_ppsync_counts_the_work_failed_with_the_cause() -> None:
    res = in_fresh_process(failure.abort_probe, "gloo", timeout_s=120)
    assert (res["ended"], res["ended_well"], res["failure_is_cause"]) == (True, False, True)
    assert res["has_aborter"] and res["abort_s"] is not None
    ok, detail = failure.abort_verdict(res)
    # gloo's one-rank broadcast may still be on its thread when looked at, or not
    premise = res["pending"] and res["ended_before"] is False
    assert ok is bool(premise) and detail.startswith("premise FALSE") is (not premise)


def test_abort_verdict() -> None:
    seen: dict[str, Any] = {
        "pending": True, "ended_before": False, "call_s": 0.0002, "abort_s": 0.05,
        "has_aborter": True, "is_completed": "returned False", "wait": "returned True",
        "ended": True, "ended_well": False, "failure_is_cause": True, "synced": "returned None",
        "is_completed_after_sync": "returned True"}
    ok, detail = failure.abort_verdict(seen)
    assert ok and "after it: is_completed() returned False, wait() returned True" in detail
    assert not failure.abort_verdict({**seen, "ended_well": True})[0]  # released unfilled
    assert not failure.abort_verdict({**seen, "failure_is_cause": False})[0]
    assert not failure.abort_verdict({**seen, "call_s": 5.0})[0]  # the abort held the engine
    assert not failure.abort_verdict({**seen, "pending": False})[0]
    assert "did not end within its bound" in failure.abort_verdict({**seen, "abort_s": None})[1]


def test_dry_run_poll_cost_probe_and_verdict() -> None:
    res = in_fresh_process(failure.poll_cost_probe, "gloo", 500, timeout_s=120)
    assert res["done_said"] == [True] and res["done_us"] > 0 and res["ended_us"] > 0
    # gloo: the "pending" one ends within µs (some calls may see it pending)
    assert failure.poll_cost_verdict(res)[0] is (res["pending_said"] == [False])
    ok, detail = failure.poll_cost_verdict({**res, "pending_said": [False]})
    assert ok and "µs/call completed" in detail


class PendingFor:
    """A stand-in work pending for ``seconds``; with ``capturing`` set, its
    query raises, as cudaEventQuery does from another thread during a
    global-mode capture."""

    def __init__(self, seconds: float) -> None:
        self.until = time.monotonic() + seconds
        self.capturing = False

    def is_completed(self) -> bool:
        if self.capturing:
            raise RuntimeError("CUDA error: operation not permitted when stream is capturing")
        return time.monotonic() >= self.until


def _survives(go_on: Any) -> tuple[str | None, bool | None]:
    while go_on():
        time.sleep(0.001)
    return None, True


@pytest.mark.parametrize("poller", ["guard", "services"])
def test_a_capture_that_survives_the_polls_passes(poller: str) -> None:
    completion = StreamOrdered("nccl")  # NCCL's completion, without a group
    start = (capture.watcher_poller(completion, Platform(torch.device("cpu")))
             if poller == "guard" else capture.services_poller(completion))
    res = capture.polled_capture(PendingFor(1.5), start, _survives, bound_s=1.2)
    assert res["pending_at_capture"] and res["polls_during"] >= 1
    assert res["poll_error"] is None and res["poller_error"] is None
    assert res["replay_ok"] is True and res["capture_error"] is None
    ok, detail = capture.capture_verdict({"guard": res, "services": res})
    assert ok and "ppsync's rank watcher polling: survived" in detail


def test_a_capture_invalidated_by_a_poll_fails_and_says_what_broke() -> None:
    work = PendingFor(5.0)

    def invalidated(go_on: Any) -> tuple[str | None, bool | None]:
        work.capturing = True
        deadline = time.monotonic() + 4.0
        while go_on() and time.monotonic() < deadline:
            time.sleep(0.001)
        return "RuntimeError: operation failed due to a previous error during capture", None

    res = capture.polled_capture(work, capture.services_poller(StreamOrdered("nccl")),
                                 invalidated, min_polls=1, bound_s=4.0)
    assert res["polls_during"] >= 1
    assert res["poll_error"].startswith("RuntimeError: CUDA error: operation not permitted")
    assert res["poller_error"] is not None  # the services' wait saw the poll raise
    ok, detail = capture.capture_verdict({"guard": res, "services": res})
    assert not ok and "watcher polling: INVALIDATED (RuntimeError" in detail
    # the services' loop on another thread is reported, not judged
    fine = {**res, "capture_error": None, "poll_error": None, "poller_error": None,
            "replay_ok": True}
    ok, detail = capture.capture_verdict({"guard": fine, "services": res})
    assert ok and "reported only): INVALIDATED" in detail


def test_dry_run_capture_probe_runs_both_pollers_and_fails_without_a_graph() -> None:
    res = in_fresh_process(capture.capture_probe, "gloo", timeout_s=120)
    assert set(res) == {"guard", "services"}
    for seen in res.values():
        assert seen["capture_error"] is None and seen["replay_ok"] is None  # no graph on CPU
        assert seen["poll_error"] is None and seen["poller_error"] is None
    ok, _ = capture.capture_verdict(res)
    assert not ok  # nothing captured, nothing replayed
