"""Where a real token path's own CPU goes, phase by phase.

:class:`PhaseTimer` wraps the objects a live :class:`TokenPath` calls (its
codec and the codec's frames and buffers, its recorder, its waits, and its
own batch-facts and issue methods) with timers, so every figure comes from
the real code with the path's own inputs; nothing is a copy of the path's
steps, and no module's globals are touched. Times are this thread's CPU
time (``time.thread_time_ns``), exclusive of the wrapped calls nested inside
(``release`` excludes ``frames.check``, ...). "other" is the step's total
less every phase: the path's own glue (role and ring bookkeeping, the
FrameView).

Each timed call adds two clock reads (measured by
:func:`clock_overhead_ns`), so the phases of a timed step sum to more than
an untimed step takes; the untimed total is the figure to compare with.
Bench-only: the wrappers are instance attributes of one path's objects.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np

from ppsync.core.path.token_path import TokenPath

cpu_now = time.thread_time_ns

_CODEC_PHASES = {
    "prepare": "checks: sampler outputs",
    "release": "release copies",
}
_FRAMES_PHASES = {
    "facts_digest": "digest",
    "pack": "pack",
    "check": "consume: frame check",
}
_KERNEL_PHASES = {
    "facts": "checks: batch, mask, slot_need",
    "sampled": "checks: sampler outputs",
    "pack": "pack",
    "release": "release copies",
}
"""The CPU kernels' calls (numba's do digest, pack and frame check inside
these; the numpy reference's nested frame calls get their own phases)."""
_BUFFER_PHASES = {"take": "buffer", "give": "buffer"}
_PATH_PHASES = {"_batch_facts": "checks: batch, mask, slot_need", "_issue": "issue"}
EXCLUDED = ("issue", "wait")
"""Phases that are not the path's own work (the collective, its waits)."""


def clock_overhead_ns(n: int = 2000) -> float:
    """Mean ns of one ``thread_time_ns`` read on this machine."""
    t0 = cpu_now()
    for _ in range(n):
        cpu_now()
    return (cpu_now() - t0) / n


class PhaseTimer:
    """Per-phase exclusive CPU ns of one path's calls, since :meth:`reset`."""

    def __init__(self, path: TokenPath) -> None:
        self.path = path
        self.ns: dict[str, int] = {}
        self._child: list[int] = []  # per open call: ns spent in nested timed calls
        codec = path.codec
        targets: list[tuple[object, dict[str, str]]] = [
            (codec, _CODEC_PHASES), (codec.kernels, _KERNEL_PHASES),
            (codec.frames, _FRAMES_PHASES), (path, _PATH_PHASES),
            (path._waits, {"wait": "wait"}),
            (path.recorder, dict.fromkeys(("issue", "consume", "complete", "call"), "recorder")),
            (codec.buffers, _BUFFER_PHASES),
        ]
        for obj, phases in targets:
            for name, phase in phases.items():
                setattr(obj, name, self._wrap(phase, getattr(obj, name)))

    def _wrap(self, phase: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        child = self._child
        ns = self.ns

        def timed(*args: Any, **kwargs: Any) -> Any:
            child.append(0)
            t0 = cpu_now()
            try:
                return fn(*args, **kwargs)
            finally:
                spent = cpu_now() - t0
                inner = child.pop()
                ns[phase] = ns.get(phase, 0) + spent - inner
                if child:
                    child[-1] += spent
        return timed

    def reset(self) -> None:
        self.ns.clear()


def phase_table(samples: list[dict[str, int]], totals_ns: np.ndarray) -> dict[str, float]:
    """Median µs per phase over steps (a phase absent from a step counts 0),
    plus "other" (median of total less phases) and "total" (median own CPU,
    issue and waits excluded)."""
    names = sorted({k for s in samples for k in s if k not in EXCLUDED})
    out: dict[str, float] = {}
    for k in names:
        out[k] = float(np.median([s.get(k, 0) for s in samples])) / 1e3
    own = np.array([sum(v for k, v in s.items() if k not in EXCLUDED) for s in samples])
    out["other"] = float(np.median(totals_ns - own)) / 1e3
    out["total"] = float(np.median(totals_ns)) / 1e3
    return out
