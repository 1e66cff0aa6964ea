"""The arithmetic that turns per-rank timestamps into ``ppsync bench``'s
figures (what it is asked and what it reports: ``ppsync.schemas.bench``).

Units: every ``*_us`` field is microseconds; raw samples are perf_counter_ns
(CLOCK_MONOTONIC, shared by every process on the machine, so timestamps of
different ranks compare directly).
"""

from __future__ import annotations

import numpy as np

__all__ = ["overdue_within", "pct_us", "ratio"]


# -- arithmetic ---------------------------------------------------------------


def pct_us(samples_ns: np.ndarray, q: float) -> float:
    """The ``q``-th percentile of ``samples_ns`` in µs (0 for no samples)."""
    if samples_ns.size == 0:
        return 0.0
    return float(np.percentile(samples_ns, q)) / 1e3


def overdue_within(
    due_ns: np.ndarray,  # [n] int64: when each heartbeat should have woken
    woke_ns: np.ndarray,  # [n] int64: when it did
    win_start_ns: np.ndarray,  # [m] int64, sorted, windows do not overlap
    win_end_ns: np.ndarray,  # [m] int64
) -> np.ndarray:
    """[n] int64: how much of each sample's lateness ``[due, woke]`` fell
    inside the windows. The windows are where lateness counts against the code
    under test (its own calls), not the benchmark's deliberate blocking."""
    if win_start_ns.size == 0:
        return np.zeros_like(due_ns)
    cum = np.concatenate(([0], np.cumsum(win_end_ns - win_start_ns)))

    def covered(t: np.ndarray) -> np.ndarray:
        i = np.searchsorted(win_start_ns, t, side="right")  # windows started by t
        tail = np.where(i > 0, win_end_ns[np.maximum(i - 1, 0)], t)
        c: np.ndarray = cum[i] - np.maximum(tail - t, 0)
        return c

    woke = np.maximum(woke_ns, due_ns)
    out: np.ndarray = covered(woke) - covered(due_ns)
    return out


def ratio(num: float, den: float) -> float:
    """num / den, or 0 when den is 0 (no figure)."""
    return num / den if den > 0 else 0.0
