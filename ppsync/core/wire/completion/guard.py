"""ppsync's bound before the backend's watchdog (docs/design.md, "When they
fail"): on a stream-ordered group every transfer is bounded from its *post*.

NCCL's watchdog measures each work from its creation against the group's
timeout and, with ``TORCH_NCCL_ASYNC_ERROR_HANDLING=3`` (torch's default),
terminates the process when one overruns it. A token path's own waits start
at the call that waits (consume, the next send), which may come long after
the post: an idle engine, slow steps. So a stream-ordered path also hands
every transfer it issues to a :class:`DeadlineGuard`: one daemon thread per
path, for the path's life, asleep while nothing is pending, that sees the oldest one still
pending ``timeout_s`` after its post and fails the group with a SyncTimeout
(``on_overdue``: the group's abort, ppsync.core.wire.completion.base). The
group's own timeout is ``timeout_s`` + NCCL_TIMEOUT_MARGIN_S, so the guard
always comes first; the path raises the error, named through the board, at
its next call.

The guard only reads the host clock and ``work.is_completed()`` (an event
query, which holds the interpreter for that one call); on CUDA it polls with
the thread's stream-capture mode made thread-local, as torch's own watchdog
does, so a CUDA graph captured meanwhile on the engine's thread is not
invalidated (ppsync.core.wire.platform.capture_safe).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from contextlib import AbstractContextManager

import torch.distributed as dist

from ppsync.errors import SyncTimeout

PERIOD_MAX_S = 0.5
"""Longest pause between two looks at the pending transfers."""


class DeadlineGuard:
    """Fails a group whose oldest pending transfer outlived ``timeout_s``
    since its post (see the module)."""

    def __init__(self, timeout_s: float, on_overdue: Callable[[SyncTimeout], None],
                 poll_guard: Callable[[], AbstractContextManager[object]]) -> None:
        """``on_overdue(error)``: called once, from the guard's thread, then
        the guard stops; ``poll_guard()``: entered around each round of
        ``is_completed()`` queries (the platform's capture-safe mode)."""
        self.timeout_s = timeout_s
        self.period_s = min(PERIOD_MAX_S, timeout_s / 8)
        self._on_overdue = on_overdue
        self._poll_guard = poll_guard
        self._works: deque[tuple[dist.Work, float, str]] = deque()  # oldest first
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopped = False

    def track(self, work: dist.Work, what: str) -> None:
        """Bound ``work`` (``what``: how errors name it) from now on."""
        with self._cond:
            if self._stopped:
                return
            self._works.append((work, time.monotonic(), what))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="ppsync-deadline",
                                                daemon=True)
                self._thread.start()
            elif len(self._works) == 1:
                self._cond.notify_all()  # the thread sleeps while nothing is pending

    def stop(self, join_s: float = 1.0) -> None:
        """No more guarding (the path closed, or its group was failed); waits
        up to ``join_s`` for the thread, unless called from it."""
        with self._cond:
            self._stopped = True
            self._works.clear()
            thread = self._thread
            self._cond.notify_all()
        if thread is not None and thread is not threading.current_thread():
            thread.join(join_s)

    def _run(self) -> None:
        overdue = None
        while overdue is None:
            with self._cond:
                while not self._works and not self._stopped:
                    self._cond.wait()
                if self._stopped:
                    return
                head = self._works[0]
            # outside the lock: a query may stall (behind an abort, a CUDA
            # lock holder), and the engine's thread must never wait for it
            with self._poll_guard():
                done = head[0].is_completed()
            with self._cond:
                if self._stopped:
                    return
                if done:
                    if self._works and self._works[0] is head:
                        self._works.popleft()
                    continue
                age = time.monotonic() - head[1]
                if age <= self.timeout_s:
                    self._cond.wait(min(self.period_s, self.timeout_s - age + 0.01))
                    continue
                overdue = SyncTimeout(f"{head[2]}: no completion within timeout_s = "
                                      f"{self.timeout_s} of its issue ({age:.1f} s pending)")
                self._stopped = True
                self._works.clear()
        self._on_overdue(overdue)
