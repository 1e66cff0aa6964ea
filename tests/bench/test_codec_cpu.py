"""``python -m ppsync.bench.codec_cpu``: the real token path's own CPU per
step, and its per-phase split, hot in one process (a tiny run: the
figures are not checked, only that every phase of the real path is found
and the table is printed)."""

from __future__ import annotations

import pytest

from ppsync.bench.codec_cpu import main


@pytest.mark.timeout(120)
def test_phase_split_names_every_phase_of_the_real_path(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["--rows", "8", "--spec", "1", "--iters", "60", "--phases"]) == 0
    out = capsys.readouterr().out
    for phase in ("checks: batch, mask, slot_need", "checks: sampler outputs", "digest",
                  "pack", "consume: frame check", "release copies", "recorder", "total"):
        assert phase in out, out


@pytest.mark.timeout(120)
def test_phase_split_of_numba_kernels_and_the_kernel_comparison(
    capsys: pytest.CaptureFixture[str],
) -> None:
    pytest.importorskip("numba", reason="numba's kernels need the extra ppsync[jit]")
    assert main(["--rows", "8", "--spec", "1", "--iters", "60", "--phases",
                 "--kernels", "numba"]) == 0
    out = capsys.readouterr().out
    assert "numba kernels" in out, out
    for phase in ("checks: batch, mask, slot_need", "pack", "release copies", "total"):
        assert phase in out, out
    assert main(["--rows", "8", "--spec", "1", "--iters", "30"]) == 0
    out = capsys.readouterr().out
    for row in ("host / numpy", "host / numba", "device"):
        assert row in out, out
