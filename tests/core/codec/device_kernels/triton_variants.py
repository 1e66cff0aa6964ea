"""How many variants Triton compiles of the two device kernels when the
codec launches them as it does per step, across row counts, widths,
expectations and the views' offsets, on no GPU: Triton's active driver is
replaced by one that names device 0 and CUDA sm_90, and every launch goes
through the kernel's own ``run`` (its binder, specialization key and cache)
with ``warmup=True``, which compiles on a cache miss and never launches.

``python tests/core/codec/device_kernels/triton_variants.py count``: the distinct keys per flag
combination (nothing compiled). ``... compile``: the set's warm-up compiles
each combination to a cubin (the seconds each took), then every launch must
hit those variants. Run with TRITON_INTERPRET=0 (used by
tests/core/codec/device_kernels/test_triton_compiles.py; the figures in docs/measured.md).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import torch
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.runtime.driver import driver

from ppsync.core import SampledStep
from ppsync.core.codec.device_kernels import Outputs
from ppsync.core.codec.device_kernels.triton_set import TritonKernels
from ppsync.core.frame.device_frames import DeviceFrames
from ppsync.schemas.config import SyncConfig

TARGET = GPUTarget("cuda", 90, 32)
ROWS = (1, 15, 16, 17, 63, 64, 65, 4096, 16384)
MAX_NUM_REQS = 16384
INTS = (torch.int32, torch.int64)


class NoGpuDriver:
    """Triton's active driver on a machine without a GPU: what ``run``
    asks before its cache lookup."""

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: object = None) -> int:
        return 0

    def get_current_target(self) -> GPUTarget:
        return TARGET


class NoLaunch:
    """A kernel as the set calls it (``kernel[grid](...)``), through
    Triton's own ``run`` with ``warmup=True``: compiles on a miss, never
    launches."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn

    def __getitem__(self, grid: tuple[int, ...]) -> Callable[..., object]:
        return lambda *a, **kw: self.fn.run(*a, grid=grid, warmup=True, **kw)

    def warmup(self, *a: object, grid: tuple[int, ...], **kw: object) -> object:
        return self.fn.warmup(*a, grid=grid, **kw)

    def cache(self) -> dict[str, object]:
        cache: dict[str, object] = self.fn.device_caches[0][0]
        return cache


def view(shape: tuple[int, ...], dtype: torch.dtype, off: int) -> torch.Tensor:
    """A tensor of ``shape`` starting ``off`` elements into its storage (off
    1: its pointer is not 16-byte aligned)."""
    size = 1
    for s in shape:
        size *= s
    return torch.zeros(size + off, dtype=dtype)[off:].view(shape)


def launches(ks: TritonKernels) -> Iterator[tuple[tuple[object, ...], Callable[[], None]]]:
    """(flag combination, launch) for every way the codec calls ``ks``."""
    K, L = ks.K, ks.L
    W, hw, words = L + 4 + K, 8, ks.staging.words
    drafts: tuple[torch.dtype | None, ...] = (None, *INTS) if K else (None,)
    for n in ROWS:
        for off in (0, 1):
            buf, stage, verdict = view((hw + n * W,), torch.int64, off), \
                view((words,), torch.int64, off), view((1,), torch.int64, off)
            for w in sorted({1, L}):
                tokens = view((n, L), torch.int64, off)[:, :w]
                for ns_t in INTS:
                    for nr_t in INTS:
                        for d_t in drafts:
                            d = None if d_t is None else view((n, K), d_t, off)
                            yield (("pack", K, ns_t, nr_t, d_t),
                                   partial(ks.pack, buf, stage, n, SampledStep(
                                           tokens, view((n,), ns_t, off),
                                           view((n,), nr_t, off), d), verdict))
                tables: tuple[torch.dtype | None, ...] = (None, *INTS)
                for hand in (False, True) if K else (False,):
                    for tab_t in tables if hand else (None,):
                        for expect in (None, True, False):
                            out = Outputs(view((n, w), torch.int64, off),
                                          view((2, n), torch.int32, off),
                                          view((n,), torch.int64, off),
                                          view((n, K), torch.int64, off) if hand else None)
                            table = (None if tab_t is None
                                     else view((MAX_NUM_REQS, K), tab_t, off))
                            yield (("release", K, hand, tab_t),
                                   partial(ks.release, buf, stage, n, expect, out, table, n,
                                           verdict))


def main(mode: str) -> None:
    driver.set_active(NoGpuDriver())
    label: list[object] = [None]
    keys: dict[tuple[object, ...], set[str]] = {}
    started: dict[str, float] = {}

    def before(*, key: str, fn: Any, **_: object) -> bool:
        keys.setdefault((fn.name, label[0]), set()).add(key)
        started[key] = time.perf_counter()
        return mode == "count"  # True: skip the compile

    def after(*, key: str, fn: Any, **_: object) -> None:
        took = time.perf_counter() - started[key]
        print(f"compile_s {fn.name} {label[0]} {took:.2f}", flush=True)

    knobs.runtime.jit_cache_hook = before
    knobs.runtime.jit_post_compile_hook = after
    sets = []
    for k in (0, 3):
        config = SyncConfig.build(pp_size=2, max_num_reqs=MAX_NUM_REQS, num_speculative_steps=k)
        ks = TritonKernels(DeviceFrames(config, torch.device("cpu")))  # CPU: no warm-up
        ks.pack_kernel, ks.release_kernel = NoLaunch(ks.pack_kernel), NoLaunch(ks.release_kernel)
        sets.append(ks)
    if mode == "compile":
        for ks in sets:
            label[0] = f"warm-up K={ks.K}"
            print(f"warm_up K={ks.K} variants {ks.warm_up()}", flush=True)
        for kernel in (sets[0].pack_kernel, sets[0].release_kernel):
            print(f"cached {kernel.fn.__name__} {len(kernel.cache())}", flush=True)
        keys.clear()  # from here on, a key is a cache miss: a compile mid-serving
    combos: set[tuple[object, ...]] = set()
    for ks in sets:
        for combo, launch in launches(ks):
            label[0] = combo
            combos.add(combo)
            launch()
    for (name, what), ks_ in sorted(keys.items(), key=str):
        print(f"keys {name} {what} {len(ks_)}", flush=True)
    print(f"missed {sum(map(len, keys.values()))}", flush=True)
    print(f"combinations {len(combos)}", flush=True)
    if mode == "compile":
        for kernel in (sets[0].pack_kernel, sets[0].release_kernel):
            print(f"cached_after {kernel.fn.__name__} {len(kernel.cache())}", flush=True)
            for compiled in kernel.cache().values():
                assert compiled.asm["cubin"], kernel.fn.__name__


if __name__ == "__main__":
    main(sys.argv[1])
