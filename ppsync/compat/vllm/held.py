"""The last rank's step held for its drafts (K > 0), and when it goes
without them.

vLLM's runner calls ``broadcast`` after sampling and ``broadcast_drafts``
after the drafter proposed, in the same call (its ``sample_tokens``); vLLM
0.33 on calls the second only when drafts were proposed that step. The
handler holds the checked step between the two, so tokens and drafts
travel as one frame. A held step never outlives its engine step: it goes
without drafts at the next call that starts a step, at close, or, when the
engine makes no further call (it went idle), from the rank's watcher thread
once the engine's call that made the step's ``broadcast`` has returned
(:meth:`HeldStep.step_ended`). The engine's call is the first frame on its
thread's stack outside ppsync's modules (and the checks' hooks): while that
frame is on the stack the step goes on, however slow its drafter (a JIT
compile is never cut short).
"""

from __future__ import annotations

import sys
import threading
from types import FrameType

from ppsync.core.codec.steps import PreparedStep

__all__ = ["HeldStep"]


class HeldStep:
    """At most one step held for its drafts, and the engine frame that made it."""

    def __init__(self) -> None:
        self.step: PreparedStep | None = None
        self._by: tuple[int, int, object] | None = None  # (thread, frame id, code)

    def hold(self, step: PreparedStep) -> None:
        """Hold ``step`` (called from the handler's ``broadcast``)."""
        self.step = step
        self._by = _engine_frame()

    def take(self) -> PreparedStep | None:
        """The held step, no longer held (None: none was)."""
        step, self.step, self._by = self.step, None, None
        return step

    def step_ended(self) -> bool:
        """Whether a step is held and the engine's call that made it has
        returned (its drafts will not come this step). From any thread."""
        by = self._by
        if self.step is None or by is None:
            return False
        thread, frame_id, code = by
        frame = sys._current_frames().get(thread)
        while frame is not None:
            if id(frame) == frame_id and frame.f_code is code:
                return False  # still in the step
            frame = frame.f_back
        return True


def _engine_frame() -> tuple[int, int, object] | None:
    """(thread, frame id, code) of the engine's frame that called into the
    handler (the first frame outside ppsync's modules and the checks' hooks)."""
    frame: FrameType | None = sys._getframe(2)
    while frame is not None and frame.f_globals.get("__name__", "").lstrip("_").startswith(
            "ppsync"):
        frame = frame.f_back
    if frame is None:
        return None
    return threading.get_ident(), id(frame), frame.f_code
