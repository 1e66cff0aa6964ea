"""docs/measured.md quotes the bench targets from their one definition,
``ppsync.bench.runner.TARGETS``: same names, same order, same limits."""

from __future__ import annotations

from pathlib import Path

import pytest

from ppsync.bench.runner import TARGETS

MEASURED = Path(__file__).resolve().parents[2] / "docs" / "measured.md"
MARK = "<!-- bench targets: ppsync/bench/runner.py TARGETS -->"


def quoted_targets(text: str) -> dict[str, tuple[float, float]]:
    """The table that follows MARK: target -> (limit at K = 0, at K = 3)."""
    assert MARK in text, f"{MEASURED.name} lacks {MARK}"
    lines = text.split(MARK, 1)[1].strip().splitlines()
    out: dict[str, tuple[float, float]] = {}
    for line in lines[2:]:  # past the head and the rule
        if not line.startswith("|"):
            break
        name, k0, k3 = (c.strip() for c in line.strip("|").split("|"))
        out[name] = (float(k0), float(k3))
    return out


def test_measured_md_quotes_the_bench_targets() -> None:
    quoted = quoted_targets(MEASURED.read_text())
    assert list(quoted.items()) == list(TARGETS.items())


def test_a_drifted_limit_is_caught() -> None:
    text = MEASURED.read_text().replace("| lockstep c/a | 1.35 |", "| lockstep c/a | 1.25 |")
    with pytest.raises(AssertionError):
        assert list(quoted_targets(text).items()) == list(TARGETS.items())
