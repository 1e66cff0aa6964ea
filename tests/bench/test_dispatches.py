"""``python -m ppsync.bench.dispatches``: torch calls per step, per role,
counted on real token paths (counts, never times)."""

from __future__ import annotations

import pytest

from ppsync.bench.codec_cpu import in_fresh_process
from ppsync.bench.dispatches import SCHEMES, count_all, main


@pytest.mark.timeout(180)
@pytest.mark.parametrize("spec", [0, 2])
def test_each_scheme_is_counted_per_role(spec: int) -> None:
    counts = in_fresh_process(count_all, 8, spec, 5)
    assert set(counts) == set(SCHEMES)
    seeds, host, device = (counts[s] for s in SCHEMES)
    for role in ("last rank", "receiver"):
        # the seeds: tokens, counts (and drafts) each in its own broadcast
        assert seeds[role].collectives == (3 if spec else 2)
        assert host[role].collectives == device[role].collectives == 1
        assert host[role].host_syncs == 0
        assert host[role].launches == 0  # numpy on the host: no torch op runs
        assert 0 < host[role].dispatches < device[role].dispatches
        assert device[role].launches <= device[role].dispatches


@pytest.mark.timeout(180)
def test_the_table_names_every_scheme_and_role(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--rows", "8", "--spec", "1", "--steps", "3"]) == 0
    out = capsys.readouterr().out
    for name in (*SCHEMES, "receiver, K=1", "last rank, K=1", "host syncs"):
        assert name in out, out
