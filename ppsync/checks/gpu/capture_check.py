"""``make gpu-check``'s check m: a CUDA graph captured on
the main thread (global capture mode: torch's default, vLLM's) while a
pending work of a one-rank NCCL token group is polled from another thread:

- by ppsync's rank watcher (ppsync.core.wire.rank_watch: the one poller
  ppsync runs off the engine's thread, under the thread-local capture
  mode, docs/design.md "Polls beside the engine"): the capture must survive,
  and its replay be right; that is the verdict;
- by ppsync's services (``await_work``) in an event loop on another thread,
  which ppsync does not do (its services poll on the engine's thread):
  reported, whatever it gives.

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

from ppsync.checks.gpu.failure_checks import (
    TIMEOUT_S,
    Result,
    issued,
    one_rank_group,
    until_completed,
)
from ppsync.checks.gpu.stream_checks import device_of
from ppsync.core.wire.completion import Completion
from ppsync.core.wire.platform import Platform, platform_for
from ppsync.core.wire.rank_watch import RankWatcher
from ppsync.errors import PPSyncError
from ppsync.services.awaiting import await_work


class PolledWork:
    """A work that notes each ``is_completed()`` call (a poll): when it began
    and what it said (None: it raised, its error kept); else the work's own."""

    def __init__(self, work: Any) -> None:
        self.work = work
        self.polls: list[tuple[float, bool | None]] = []
        self.errors: list[str] = []

    def is_completed(self) -> bool:
        t = time.perf_counter()
        try:
            done = bool(self.work.is_completed())
        except Exception as e:
            self.polls.append((t, None))
            self.errors.append(f"{type(e).__name__}: {str(e)[:160]}")
            raise
        self.polls.append((t, done))
        return done

    def __getattr__(self, name: str) -> Any:
        return getattr(self.work, name)


Capture = Callable[[Callable[[], bool]], tuple[str | None, bool | None]]
"""Captures while its argument says to go on; (the capture's error or None,
whether the replay gave the right result, None where it did not run)."""

Poller = Callable[[PolledWork], Callable[[], str | None]]
"""Starts polling a work from another thread; returns what waits (bounded)
for that poller to be done with it and says the error it met, or None."""


class _OneWork:
    """What the rank watcher watches here: one work, until it said it is done."""

    def __init__(self, polled: PolledWork) -> None:
        self.polled = polled
        self.error: PPSyncError | None = None

    def outstanding(self) -> list[dist.Work]:
        return [] if _said_done(self.polled) else [cast(dist.Work, self.polled)]

    def step_count(self) -> int:
        return 0

    def fail_in_background(self, err: PPSyncError, observed: bool) -> PPSyncError:
        self.error = self.error or err
        return self.error

    def failure(self) -> PPSyncError | None:
        return self.error

    def tick(self) -> None:
        pass

    def hurry(self) -> bool:
        return False


def watcher_poller(completion: Completion, platform: Platform) -> Poller:
    """ppsync's rank watcher, polling the work (its cap: GUARD_TIMEOUT_S)."""
    def start(polled: PolledWork) -> Callable[[], str | None]:
        watched = _OneWork(polled)
        watcher = RankWatcher(watched, board=None, me=0, ranks=[0], peers=[],
                              completion=completion, platform=platform, silent_s=60.0,
                              max_pending_s=GUARD_TIMEOUT_S)
        watcher.start()

        def finish() -> str | None:
            deadline = time.monotonic() + TIMEOUT_S
            while not _said_done(polled) and time.monotonic() < deadline:
                time.sleep(0.01)
            watcher.stop()
            err = watched.error
            return None if err is None else f"the watcher failed the path: {err}"

        return finish

    return start


def services_poller(completion: Completion) -> Poller:
    """ppsync's services' wait (``await_work``) in an event loop on another thread."""
    def start(polled: PolledWork) -> Callable[[], str | None]:
        error: list[str] = []

        async def wait() -> None:
            await await_work(cast(dist.Work, polled), timeout_s=TIMEOUT_S, what="gpu-check m",
                             completion=completion)

        def loop() -> None:
            try:
                anyio.run(wait)
            except Exception as e:
                error.append(f"{type(e).__name__}: {str(e)[:160]}")

        thread = threading.Thread(target=loop, name="services-loop", daemon=True)
        thread.start()

        def finish() -> str | None:
            thread.join(TIMEOUT_S)
            return error[0] if error else None

        return finish

    return start


def polled_capture(work: Any, poller: Poller, capture: Capture, min_polls: int = 2,
                   bound_s: float = 1.5) -> Result:
    """Start ``poller`` on ``work``, then run ``capture`` on this thread once
    the first poll came, going on until ``min_polls`` polls that found the
    work pending fell inside it, or ``bound_s`` passed."""
    polled = PolledWork(work)
    finish = poller(polled)
    deadline = time.monotonic() + 5.0
    while not polled.polls and time.monotonic() < deadline:
        time.sleep(0.001)
    pending = bool(polled.polls) and not _said_done(polled)
    t0 = time.perf_counter()

    def inside(t1: float) -> int:
        return sum(1 for t, done in polled.polls if t0 <= t <= t1 and done is not True)

    def go_on() -> bool:
        now = time.perf_counter()
        return inside(now) < min_polls and now - t0 < bound_s

    error, replay_ok = capture(go_on)
    t1 = time.perf_counter()
    return {"pending_at_capture": pending, "capture_ms": (t1 - t0) * 1e3,
            "polls_during": inside(t1), "capture_error": error, "replay_ok": replay_ok,
            "poll_error": polled.errors[0] if polled.errors else None,
            "poller_error": finish()}


def _said_done(polled: PolledWork) -> bool:
    with contextlib.suppress(Exception):
        return bool(polled.work.is_completed())
    return False


def cuda_capture(dev: torch.device) -> Capture:
    """A capture of ``x.add_(1)`` launches on a side stream, in the global
    capture mode (torch's default, vLLM's), 1 ms apart once 200 are in (the
    graph stays small however long the capture waits for polls); then a
    replay, checked."""
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
                    if n > 200:
                        time.sleep(0.001)
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


GUARD_TIMEOUT_S = 4.0
"""The guard's timeout_s in m: its look period is timeout_s / 8 (0.5 s), and
the work must end (2 s behind) well before it would be overdue."""


def capture_probe(backend: str, behind_s: float = 2.0) -> Result:
    """m on this device: a broadcast pending behind ``behind_s`` of kernel
    polled by ppsync's rank watcher while the main thread captures; then
    another, polled by the services' loop on another thread."""
    dev = device_of(0)
    res: Result = {}
    with one_rank_group(backend) as (group, completion):
        capture: Capture = (cuda_capture(dev) if dev.type == "cuda"
                            else lambda go_on: (None, None))  # the dry run: no graphs
        platform = platform_for(dev)
        completion.bind(group, GUARD_TIMEOUT_S, platform)
        for name, poller in (("guard", watcher_poller(completion, platform)),
                             ("services", services_poller(completion))):
            work, _ = issued(group, dev, behind_s)
            res[name] = polled_capture(work, poller, capture)
            with contextlib.suppress(Exception):  # after an invalidated capture it may raise
                until_completed(work, behind_s + 10.0)
    return res


def _outcome(res: Result) -> str:
    seen = (f"{res['polls_during']} polls of the pending work in a "
            f"{res['capture_ms']:.0f} ms capture")
    if res["capture_error"] is None and res["poll_error"] is None and res["replay_ok"]:
        return f"survived {seen}, replay right"
    capture = f"INVALIDATED ({res['capture_error']})" if res["capture_error"] else "ran"
    return (f"{capture}, {seen}; a poll raised: {res['poll_error']}; the poller: "
            f"{res['poller_error']}; replay right: {res['replay_ok']}")


def capture_verdict(res: Result) -> tuple[bool, str]:
    """m passes when the capture survived the rank watcher's polls of a
    pending work inside it (the premise: there were some) and its replay
    was right; the services-on-another-thread outcome is reported only."""
    guard, services = res["guard"], res["services"]
    premise = guard["pending_at_capture"] and guard["polls_during"] > 0
    ok = bool(premise and guard["capture_error"] is None and guard["poll_error"] is None
              and guard["poller_error"] is None and guard["replay_ok"])
    return ok, (("" if premise else "premise FALSE (no poll of a pending work during the "
                 "capture); ")
                + f"global-mode capture on the main thread; ppsync's rank watcher polling: "
                f"{_outcome(guard)} | the services' loop on another thread (not ppsync's "
                f"way; reported only): {_outcome(services)}")


def check_m() -> tuple[bool, str]:
    return capture_verdict(capture_probe("nccl"))
