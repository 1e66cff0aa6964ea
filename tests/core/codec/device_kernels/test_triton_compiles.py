"""The Triton kernels compile for a GPU, here, without one: Triton's
compiler takes each kernel through TTIR, TTGIR, LLVM IR and PTX to a cubin
for CUDA sm_90 (an H100 / H200), launched as the Triton set launches it,
through the kernel's own ``run`` (tests/core/codec/device_kernels/triton_variants.py). The
interpreter (the other tests) runs the kernels' logic; this catches what
only the compiler checks (types, loop bounds, masks), and counts the
variants: one per flag combination, all compiled by the set's warm-up."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ppsync.core.codec.device_kernels import triton_error

pytestmark = pytest.mark.skipif(
    triton_error() is not None,
    reason=f"Triton cannot be loaded ({triton_error()}): install ppsync[triton]")

VARIANTS = Path(__file__).with_name("triton_variants.py")


def _variants(mode: str, tmp_path: Path) -> str:
    env = {"TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(tmp_path),
           "TRITON_DEFAULT_FP_FUSION": "1"}
    run = subprocess.run([sys.executable, str(VARIANTS), mode], capture_output=True, text=True,
                         timeout=560, env={**os.environ, **env})
    assert run.returncode == 0, run.stderr[-4000:]
    return run.stdout


def _keys(out: str) -> dict[str, int]:
    return {line.rsplit(" ", 1)[0]: int(line.rsplit(" ", 1)[1])
            for line in out.splitlines() if line.startswith("keys ")}


@pytest.mark.timeout(120)
def test_one_specialization_key_per_flag_combination(tmp_path: Path) -> None:
    """Issue 26 item 5: across n in {1, 15, 16, 17, 63, 64, 65, 4096,
    16384}, widths 1 and L, every expectation, and views at aligned and
    unaligned offsets, each flag combination the codec launches (K = 0 / 3,
    drafts absent / int32 / int64, num_sampled's and num_rejected's dtypes,
    a table absent / int32 / int64) has one specialization key: Triton's
    own binder and key, nothing compiled."""
    out = _variants("count", tmp_path)
    keys = _keys(out)
    assert "combinations 21" in out, out
    assert len(keys) == 21 and set(keys.values()) == {1}, keys


@pytest.mark.timeout(600)
def test_the_warm_up_compiles_every_variant_and_launches_compile_nothing(
        tmp_path: Path) -> None:
    """The set's warm-up compiles one cubin for sm_90 per flag combination
    (16 pack, 5 release over K = 0 and 3); then every launch above hits
    those variants: the kernels' caches do not grow."""
    out = _variants("compile", tmp_path)
    assert "warm_up K=0 variants 5" in out and "warm_up K=3 variants 16" in out, out
    assert "cached pack_frame 16" in out and "cached check_release 5" in out, out
    assert "cached_after pack_frame 16" in out and "cached_after check_release 5" in out, out
    assert out.count("compile_s ") == 21, out
    assert "missed 0" in out, out  # no launch missed the warm-up's variants
