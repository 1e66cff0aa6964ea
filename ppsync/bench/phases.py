"""Where a real token path's own CPU goes, phase by phase.

:class:`PhaseTimer` wraps the functions a live :class:`TokenPath` calls (the
names the handler module imported, the path's codec, recorder and its own
issue / wait / release methods) with timers, so every figure comes from the
real code with the path's own inputs; nothing is a copy of the path's steps.
Times are this thread's CPU time (``time.thread_time_ns``), exclusive of the
wrapped calls nested inside (``release`` excludes ``codec.check``, ...).
"other" is the step's total less every phase: the path's own glue (role and
ring bookkeeping, the idx_mapping copy, the FrameView).

Each timed call adds two clock reads (~0.1-0.3 µs each, measured by
:func:`clock_overhead_ns`), so the phases of a timed step sum to more than
an untimed step takes; the untimed total is the figure to compare with.
Bench-only: the wrappers patch the handler module's globals while installed
and :meth:`PhaseTimer.remove` puts them back.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np

import ppsync.core.handler as handler_mod
from ppsync.core.handler import TokenPath

cpu_now = time.thread_time_ns

_MODULE_PHASES = {
    "batch_facts": "checks: batch, mask, slot_need",
    "check_sampled": "checks: sampler outputs",
    "check_step_drafts": "checks: drafts",
    "check_draft_target": "checks: draft target",
    "release_host": "release copies",
}
_CODEC_PHASES = {
    "facts_digest": "digest",
    "new_buffer": "buffer",
    "pack": "pack",
    "check": "consume: frame check",
    "recycle": "buffer",
}
_PATH_PHASES = {"_issue": "issue", "_wait": "wait"}
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
        self._saved: dict[str, Any] = {}
        for name, phase in _MODULE_PHASES.items():
            self._saved[name] = getattr(handler_mod, name)
            setattr(handler_mod, name, self._wrap(phase, self._saved[name]))
        for name, phase in _CODEC_PHASES.items():
            setattr(path.codec, name, self._wrap(phase, getattr(path.codec, name)))
        for name, phase in _PATH_PHASES.items():
            setattr(path, name, self._wrap(phase, getattr(path, name)))
        rec = path.recorder
        for name in ("issue", "consume", "complete", "call"):
            setattr(rec, name, self._wrap("recorder", getattr(rec, name)))

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

    def remove(self) -> None:
        """Put the handler module's functions back (instances keep theirs)."""
        for name, fn in self._saved.items():
            setattr(handler_mod, name, fn)


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
