"""The Triton kernels compile for a GPU, here, without one: Triton's
compiler takes each kernel through TTIR, TTGIR, LLVM IR and PTX to a cubin
for CUDA sm_90 (an H100 / H200), with the constants the Triton set launches
it with. The interpreter (the other tests) runs the kernels' logic; this
catches what only the compiler checks (types, loop bounds, masks)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from ppsync.core.device_kernels import triton_error

pytestmark = pytest.mark.skipif(
    triton_error() is not None,
    reason=f"Triton cannot be loaded ({triton_error()}): install ppsync[triton]")

SCRIPT = textwrap.dedent("""
    import torch, triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from ppsync.core.device_kernels.triton_set import TritonKernels
    from ppsync.core.frame.device_frames import DeviceFrameCodec
    from ppsync.schemas.config import SyncConfig

    TARGET = GPUTarget("cuda", 90, 32)

    def compile_(fn, types, consts):
        sig = {**types, **{k: "constexpr" for k in consts}}
        assert list(sig) == fn.arg_names, (list(sig), fn.arg_names)
        at = {(fn.arg_names.index(k),): v for k, v in consts.items()}
        kernel = triton.compile(ASTSource(fn, sig, constexprs=at), target=TARGET)
        assert kernel.asm["cubin"], fn.__name__
        print("compiled", fn.__name__, consts.get("K"), flush=True)

    p, i32, i64 = "*i64", "i32", "i64"
    for k in (0, 3):
        config = SyncConfig.build(pp_size=2, max_num_reqs=256, num_speculative_steps=k)
        ks = TritonKernels(DeviceFrameCodec(config, torch.device("cpu")))
        common, release = ks._common, ks._release
        for drafts in ((False, True) if k else (False,)):
            pack_types = dict(buf_ptr=p, stage_ptr=p, fw_ptr=p, tok_ptr=p, ns_ptr="*i32",
                              nr_ptr="*i32", dr_ptr=p, verdict_ptr=p, n=i32, w=i32,
                              tok_s0=i32, tok_s1=i32, ns_s=i32, nr_s=i32, dr_s0=i32,
                              dr_s1=i32)
            compile_(ks.pack_kernel, pack_types,
                     dict(L=common["L"], K=common["K"], HAS_DRAFTS=drafts,
                          **{n: common[n] for n in ("HW", "BOUNDS", "FACTS", "FLAG_BAD",
                                                    "BR", "BW")}))
            release_types = dict(buf_ptr=p, stage_ptr=p, fw_ptr=p, tok_ptr=p, cnt_ptr="*i32",
                                 idx_ptr=p, dr_ptr=p, tab_ptr="*i32", verdict_ptr=p, n=i32,
                                 w=i32, kept=i32, expect=i32, tab_s0=i32, tab_s1=i32)
            compile_(ks.release_kernel, release_types,
                     dict(L=common["L"], K=common["K"], HAND_DRAFTS=drafts, HAS_TABLE=drafts,
                          **{n: common[n] for n in ("HW", "BOUNDS", "FACTS")},
                          **{n: release[n] for n in ("IDX_OUT", "KEPT_SLOTS", "KEPT_ROWS")},
                          FLAG_BAD=common["FLAG_BAD"], FLAG_DRAFTS=release["FLAG_DRAFTS"],
                          BR=common["BR"], BW=common["BW"], BK=release["BK"]))
""")


@pytest.mark.timeout(300)
def test_both_kernels_compile_to_a_cubin_for_sm_90(tmp_path: Path) -> None:
    env = {"TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(tmp_path),
           "TRITON_DEFAULT_FP_FUSION": "1"}
    run = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                         timeout=240, env={**os.environ, **env})
    assert run.returncode == 0, run.stderr[-4000:]
    assert run.stdout.count("compiled pack_frame") == 3, run.stdout
    assert run.stdout.count("compiled check_release") == 3, run.stdout
