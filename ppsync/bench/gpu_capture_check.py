"""``make gpu-check``'s check m (issue 32, item 7): a CUDA graph captured on
the main thread (global capture mode: torch's default, vLLM's) while
ppsync's services poll a pending work from their event loop's thread, on a
one-rank NCCL token group: whether the capture survives, and what the poll
and the services' wait saw. It reports the outcome either way.

The capture calls ``CUDAGraph.capture_begin`` directly: ``torch.cuda.graph``
synchronizes the device on entry, so with it no work is pending during a
capture (and a pending cross-rank receive holds the capture's start until
its peer sends). The probe also runs on CPU over gloo (the tests' dry run),
where nothing stays pending: the verdict then says the premise is false.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from typing import Any, cast

import anyio
import torch
import torch.distributed as dist

from ppsync.bench.gpu_failure_checks import (
    TIMEOUT_S,
    Result,
    issued,
    one_rank_group,
    until_completed,
)
from ppsync.bench.gpu_stream_checks import device_of
from ppsync.core.completion import Completion
from ppsync.services.completion import await_work


class PolledWork:
    """A work that notes when each ``is_completed()`` call (a poll) began,
    and what a failed one raised; everything else is the work's own."""

    def __init__(self, work: Any) -> None:
        self.work = work
        self.polls: list[float] = []
        self.errors: list[str] = []

    def is_completed(self) -> bool:
        self.polls.append(time.perf_counter())
        try:
            return bool(self.work.is_completed())
        except Exception as e:
            self.errors.append(f"{type(e).__name__}: {str(e)[:160]}")
            raise

    def __getattr__(self, name: str) -> Any:
        return getattr(self.work, name)


Capture = Callable[[Callable[[], bool]], tuple[str | None, bool | None]]
"""Captures while its argument says to go on; (the capture's error or None,
whether the replay gave the right result, None where it did not run)."""


def polled_capture(work: Any, completion: Completion, capture: Capture,
                   min_polls: int = 3, bound_s: float = 0.5) -> Result:
    """Run ppsync's services' wait on ``work`` (``await_work``: polls on a
    stream-ordered group) in an event loop on another thread, and
    ``capture`` on this one once the first poll came, going on until
    ``min_polls`` polls fell inside it or ``bound_s`` passed."""
    polled = PolledWork(work)
    loop_error: list[str] = []

    def services() -> None:
        async def wait() -> None:
            await await_work(cast(dist.Work, polled), timeout_s=TIMEOUT_S, what="gpu-check m",
                             peer=None, completion=completion)
        try:
            anyio.run(wait)
        except Exception as e:
            loop_error.append(f"{type(e).__name__}: {str(e)[:160]}")

    loop = threading.Thread(target=services, name="services-loop", daemon=True)
    loop.start()
    deadline = time.monotonic() + 5.0
    while not polled.polls and time.monotonic() < deadline:
        time.sleep(0.001)
    pending = bool(polled.polls) and not _said_done(polled)
    t0 = time.perf_counter()

    def go_on() -> bool:
        inside = sum(1 for p in polled.polls if p >= t0)
        return inside < min_polls and time.perf_counter() - t0 < bound_s

    error, replay_ok = capture(go_on)
    t1 = time.perf_counter()
    loop.join(TIMEOUT_S)
    return {"pending_at_capture": pending, "capture_ms": (t1 - t0) * 1e3,
            "polls_during": sum(1 for p in polled.polls if t0 <= p <= t1),
            "capture_error": error, "replay_ok": replay_ok,
            "poll_error": polled.errors[0] if polled.errors else None,
            "services_error": loop_error[0] if loop_error else None}


def _said_done(polled: PolledWork) -> bool:
    with contextlib.suppress(Exception):
        return bool(polled.work.is_completed())
    return False


def cuda_capture(dev: torch.device) -> Capture:
    """A capture of ``x.add_(1)`` launches on a side stream, in the global
    capture mode (torch's default, vLLM's), then a replay checked."""
    def capture(go_on: Callable[[], bool]) -> tuple[str | None, bool | None]:
        stream = torch.cuda.Stream(dev)  # type: ignore[no-untyped-call]
        x = torch.zeros(1024, device=dev)
        graph = torch.cuda.CUDAGraph()
        n, error = 0, None
        with torch.cuda.stream(stream):
            graph.capture_begin(capture_error_mode="global")
            try:
                while n < 200 or go_on():
                    x.add_(1)
                    n += 1
            except Exception as e:
                error = f"{type(e).__name__}: {str(e)[:160]}"
            finally:
                try:
                    graph.capture_end()
                except Exception as e:
                    error = error or f"{type(e).__name__}: {str(e)[:160]}"
        if error is not None:
            return error, None
        x.zero_()
        graph.replay()
        torch.cuda.synchronize(dev)
        return None, bool((x == n).all().item())

    return capture


def capture_probe(backend: str, behind_s: float = 2.0) -> Result:
    """m on this device: a broadcast pending behind ``behind_s`` of kernel
    polled by the services while the main thread captures."""
    dev = device_of(0)
    with one_rank_group(backend) as (group, completion):
        work, _ = issued(group, dev, behind_s)
        if dev.type == "cuda":
            res = polled_capture(work, completion, cuda_capture(dev))
        else:  # the dry run: no graphs; the work is complete already
            res = polled_capture(work, completion, lambda go_on: (None, None))
        with contextlib.suppress(Exception):  # after an invalidated capture it may raise
            until_completed(work, behind_s + 10.0)
    return res


def capture_verdict(res: Result) -> tuple[bool, str]:
    """m passes when the capture survived polls that fell inside it, and its
    replay was right; the premise: the work was pending and polled then."""
    premise = res["pending_at_capture"] and res["polls_during"] > 0
    ok = bool(premise and res["capture_error"] is None and res["poll_error"] is None
              and res["services_error"] is None and res["replay_ok"])
    seen = (f"{res['polls_during']} polls during a {res['capture_ms']:.1f} ms capture "
            "(global mode, main thread; the services' loop on another thread)")
    if not premise:
        return False, f"premise FALSE (no poll of a pending work during the capture): {seen}"
    if ok:
        return True, f"capture survived {seen}; replay right"
    capture = f"INVALIDATED: {res['capture_error']}" if res["capture_error"] else "ran"
    return False, (f"capture {capture}; {seen}; a poll raised: {res['poll_error']}; "
                   f"the services' wait: {res['services_error']}; replay right: "
                   f"{res['replay_ok']}")


def check_m() -> tuple[bool, str]:
    return capture_verdict(capture_probe("nccl"))
