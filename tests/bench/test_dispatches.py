"""``python -m ppsync.bench.dispatches``: torch calls per step, per role,
counted on real token paths (counts, never times)."""

from __future__ import annotations

import pytest

from ppsync.bench.dispatches import SCHEMES, call_targets, count_all, main
from ppsync.core.codec.device_kernels import triton_error
from ppsync.harness.fresh import in_fresh_process

TRITON = triton_error()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("spec", [0, 2])
def test_each_scheme_is_counted_per_role(spec: int) -> None:
    counts = in_fresh_process(count_all, 8, spec, 5)
    assert set(counts) == set(SCHEMES if TRITON is None else SCHEMES[:3])
    vllm, host, device = (counts[s] for s in SCHEMES[:3])
    for role in ("last rank", "receiver"):
        # the vllm: tokens, counts (and drafts) each in its own broadcast
        assert vllm[role].collectives == (3 if spec else 2)
        assert host[role].collectives == device[role].collectives == 1
        assert host[role].host_syncs == 0
        assert host[role].launches == 0  # numpy on the host: no torch op runs
        assert 0 < host[role].dispatches < device[role].dispatches
        assert device[role].launches <= device[role].dispatches
        assert device[role].triton == 0 < device[role].kernels <= device[role].launches
        assert device[role].calls == device[role].dispatches + 1
    targets = call_targets(counts)
    assert {t.name for t in targets} >= {"torch-op calls receiver / vLLM's"}


@pytest.mark.timeout(180)
@pytest.mark.skipif(TRITON is not None, reason=f"Triton cannot be loaded ({TRITON}): "
                    "install ppsync[triton]")
@pytest.mark.parametrize("spec", [0, 2])
def test_the_triton_set_is_one_launch_per_role(spec: int) -> None:
    """Counted through the interpreter's launches (its own torch calls are
    not the codec's): one Triton kernel and one collective per step and
    role, no host sync, no other compute kernel; at most vLLM's scheme's calls on
    the last rank."""
    counts = in_fresh_process(count_all, 8, spec, 3)
    vllm, triton = counts[SCHEMES[0]], counts[SCHEMES[3]]
    for role in ("last rank", "receiver"):
        c = triton[role]
        assert (c.triton, c.kernels, c.collectives, c.host_syncs) == (1, 1, 1, 0), c
    assert triton["last rank"].calls <= vllm["last rank"].calls
    met = {t.name: t.met for t in call_targets(counts)}
    assert met["triton calls last rank / vLLM's"] and met["triton host syncs receiver"]


@pytest.mark.timeout(180)
def test_the_table_names_every_scheme_and_role(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--rows", "8", "--spec", "1", "--steps", "3"]) == 0
    out = capsys.readouterr().out
    for name in (*SCHEMES, "receiver, K=1", "last rank, K=1", "host syncs"):
        assert name in out, out
