"""``make gpu-check``'s checks a-e: the workload, a one-rank NCCL token
group, the timed frame over NCCL, a late peer, the per-step costs
(docs/operations.md, "GPU check"; the table: ppsync.checks.gpu.check).

Each ``check_*`` returns (passed, detail) and runs in a fresh process of its
own (ppsync.harness.fresh); its ranks are fresh processes too (spawned: CUDA
does not survive a fork). Each rank function also runs on CPU over gloo with
CPU tensors: the tests' dry run (tests/checks/gpu/test_gpu_check.py).
"""

from __future__ import annotations

import functools
import statistics
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import torch
import torch.distributed as dist

from ppsync.checks.gpu.step_costs import sync_guard_live, time_schemes, timing_verdict
from ppsync.checks.gpu.stream_checks import (
    carrier_over,
    decode_view,
    device_of,
    late_peer_async_rank,
    main_stream_work,
)
from ppsync.core.codec.device_kernels import triton_error
from ppsync.core.frame.rows import SampledStep
from ppsync.core.path.token_path import TokenPath
from ppsync.core.wire.groups import token_group
from ppsync.errors import BatchError
from ppsync.harness.driver import run_sync_rank, workload_config
from ppsync.harness.launcher import RankEnv, spawn_ranks
from ppsync.schemas.config import SyncConfig
from ppsync.schemas.run_report import RankReport

TIMEOUT_S = 30.0
"""The token paths' timeout_s here (and each rank launch's bound)."""
LATE_S = 3.0
"""How late d's peer publishes."""
Result = dict[str, Any]


@contextmanager
def no_host_sync(mode: str, found: list[str]) -> Iterator[None]:
    """Run the block under ``torch.cuda.set_sync_debug_mode(mode)``; in
    "warn" mode, collect the sync warnings raised in this thread. Without
    CUDA (the CPU dry run of the tests) the block just runs."""
    if not torch.cuda.is_available():
        yield
        return
    torch.cuda.set_sync_debug_mode(mode)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield
    finally:
        torch.cuda.set_sync_debug_mode(0)
    found.extend(str(w.message) for w in caught if "synchroniz" in str(w.message).lower())


def _hot(mode: str, found: list[str]) -> Callable[[], AbstractContextManager[None]]:
    return functools.partial(no_host_sync, mode, found)


def delivered_exactly(report: RankReport) -> bool:
    """No row lost, stale, duplicated or corrupt; the last rank sent rows,
    a receiver got every row it expected."""
    clean = (report.lost, report.stale, report.duplicated, report.corrupt) == (0, 0, 0, 0)
    if report.role == "last":
        return clean and report.rows_sent > 0
    return clean and report.rows_delivered == report.rows_expected > 0


def _config(pp_size: int, backend: str, **extra: Any) -> SyncConfig:
    """The device codec over a ``backend`` token group: the device carrier
    on NCCL (the host carrier is refused there), the host carrier on gloo."""
    return SyncConfig.build(pp_size=pp_size, max_num_reqs=64, num_speculative_steps=2,
                            timeout_s=TIMEOUT_S, codec="device",
                            carrier=carrier_over(backend), **extra)


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def kernel_sets() -> list[str]:
    """The device kernel sets this machine runs compiled: torch ops, and
    Triton where it imports (TRITON_INTERPRET unset or 0 here)."""
    return ["torch"] + (["triton"] if triton_error() is None else [])


# -- the rank functions ----------------------------------------------------------------


def workload_rank(steps: int, backend: str, mode: str, kernels: str, env: RankEnv) -> Result:
    dev = device_of(env.rank)
    config = _config(env.world_size, backend, device_kernels=kernels)
    group = token_group(dist.group.WORLD, timeout_s=TIMEOUT_S,  # type: ignore[arg-type]
                        backend=backend)
    path = TokenPath(config, group, device=dev)
    assert path.codec.device_kernels_name == kernels
    found: list[str] = []
    report = run_sync_rank(path, workload_config(config, steps=steps, seed=11),
                           hot=_hot(mode, found))
    return {"exact": delivered_exactly(report), "syncs": found[:3], "report": report.model_dump()}


def one_rank_rank(backend: str, env: RankEnv) -> Result:
    """b: a valid step, then one with a bad num_sampled, whose BatchError
    must come at the next call (a deferred verdict)."""
    dev = device_of(0)
    group = token_group(dist.group.WORLD, timeout_s=TIMEOUT_S,  # type: ignore[arg-type]
                        backend=backend)
    path = TokenPath(_config(1, backend), group, device=dev)
    view = decode_view(4)
    tokens = torch.arange(12, device=dev, dtype=torch.int64).view(4, 3)
    ns = torch.full((4,), 3, dtype=torch.int32, device=dev)
    nr = torch.zeros(4, dtype=torch.int32, device=dev)
    found: list[str] = []
    with no_host_sync("error", found):
        path.publish(view, SampledStep(tokens, ns, nr))
        path.publish(view, SampledStep(tokens, ns + 2, nr))  # num_sampled 5 > w = 3: sent, flagged
    _sync(dev)  # let the events complete: the next call reads the verdict
    try:
        path.publish(view, SampledStep(tokens, ns, nr))
        deferred = "no BatchError at the next call"
    except BatchError as e:
        deferred = "" if "num_sampled[0] = 5 outside [0, w = 3]" in str(e) else str(e)
    path.close()
    return {"ok": not deferred and not found, "detail": deferred or "; ".join(found)}


def timed_rank(iters: int, backend: str, env: RankEnv) -> Result:
    """The fused frame vs one raw broadcast vs vLLM's scheme's three broadcasts,
    interleaved; median µs per step as seen by this rank."""
    dev = device_of(env.rank)
    P, rows, K = env.world_size, 256, 2
    L = K + 1
    nccl = token_group(dist.group.WORLD, timeout_s=TIMEOUT_S,  # type: ignore[arg-type]
                       backend=backend)
    config = SyncConfig.build(pp_size=P, max_num_reqs=rows, num_speculative_steps=K,
                              ring_depth=1, timeout_s=TIMEOUT_S, codec="device",
                              carrier=carrier_over(backend))
    path = TokenPath(config, nccl, device=dev)
    src = dist.get_global_rank(nccl, P - 1)
    view = decode_view(rows)
    tokens = torch.randint(0, 1 << 20, (rows, L), device=dev)
    ns = torch.full((rows,), L, dtype=torch.int32, device=dev)
    nr = torch.zeros(rows, dtype=torch.int32, device=dev)
    drafts = torch.randint(0, 1 << 20, (rows, K), device=dev)
    raw = torch.zeros(path.codec.frames.words(rows), dtype=torch.int64, device=dev)
    counts = torch.zeros(2 * rows, dtype=torch.int32, device=dev)

    def fused() -> None:
        if path.is_last:
            path.publish(view, SampledStep(tokens, ns, nr, drafts))
        else:
            path.post(view)
            path.consume()

    def one_raw() -> None:
        dist.broadcast(raw, src=src, group=nccl)

    def vllm() -> None:
        for t in (tokens, counts, drafts):
            dist.broadcast(t, src=src, group=nccl)

    variants = {"fused frame": fused, "raw broadcast": one_raw, "vLLM's scheme": vllm}
    if not path.is_last:
        assert path.consume() is None  # D = 1: reserves the tail each post() fills
    times: dict[str, list[float]] = {k: [] for k in variants}
    for i in range(iters + 20):
        for name, fn in variants.items():
            dist.barrier()  # the default (gloo) group: every rank starts together
            t0 = time.perf_counter()
            fn()
            _sync(dev)
            if i >= 20:
                times[name].append((time.perf_counter() - t0) * 1e6)
    path.close()  # the tail reserved by the last consume() stays an empty slot
    return {k: statistics.median(v) for k, v in times.items()}


def late_peer_rank(backend: str, late_s: float, env: RankEnv) -> Result:
    """d through the sync API. The receiver posts, queues a matmul chain on
    its main stream and times both to the chain's end (``main_s``: from
    before post(), so a post that blocks the host counts too), then
    consumes; ``frame_s``: post() to the frame's arrival."""
    dev = device_of(env.rank)
    group = token_group(dist.group.WORLD, timeout_s=TIMEOUT_S,  # type: ignore[arg-type]
                        backend=backend)
    path = TokenPath(_config(2, backend, ring_depth=1), group, device=dev)
    view = decode_view(8)
    if path.is_last:
        time.sleep(late_s)  # the late peer
        tokens = torch.arange(24, device=dev, dtype=torch.int64).view(8, 3)
        path.publish(view, SampledStep(
            tokens, torch.full((8,), 3, dtype=torch.int32, device=dev),
            torch.zeros(8, dtype=torch.int32, device=dev)))
        path.close()
        return {}
    assert path.consume() is None
    t0 = time.perf_counter()
    path.post(view)
    main_stream_work(dev)
    main_s = time.perf_counter() - t0
    out = path.consume()
    frame_s = time.perf_counter() - t0
    got = None if out is None else out.sampled_tokens.cpu().flatten().tolist()
    path.close()
    return {"main_s": main_s, "frame_s": frame_s, "delivered": got == list(range(24))}


def late_peer_verdict(api: str, res: Result, late_s: float) -> tuple[bool, str]:
    """d's verdict on a receiver's result: delivered; the main stream's work
    (and post()) done in under half the peer's delay; and the premise, that
    the frame really came late (at least half the delay after post()):
    otherwise nothing was pending and the check showed nothing."""
    main_s, frame_s, delivered = res["main_s"], res["frame_s"], res["delivered"]
    premise = frame_s >= late_s / 2
    ok = bool(delivered) and premise and main_s < late_s / 2
    note = "" if premise else " (premise false: the frame was not late, nothing was pending)"
    return ok, (f"{api}: post() + main stream done {main_s:.2f} s, frame {frame_s:.2f} s "
                f"after post(), delivered={delivered}{note}")


# -- the checks --------------------------------------------------------------------------


def check_a(steps: int) -> tuple[bool, str]:
    if not sync_guard_live(device_of(0)):
        return False, "sync debug mode catches no host sync here: the check cannot fail"
    details, ok = [], True
    for kernels in kernel_sets():
        res = spawn_ranks(functools.partial(workload_rank, steps, "gloo", "warn", kernels), 2,
                          timeout_s=TIMEOUT_S, start_method="spawn")
        syncs = [s for r in res for s in r["syncs"]]
        rows = res[0]["report"]["rows_delivered"]
        good = all(r["exact"] for r in res) and not syncs
        ok &= good
        details.append(f"{kernels}: {steps} steps, {rows} rows delivered exactly" if good else
                       f"{kernels}: exact={[r['exact'] for r in res]} host syncs: {syncs[:2]}")
    return ok, "host carrier (the default); " + "; ".join(details)


def check_b() -> tuple[bool, str]:
    (res,) = spawn_ranks(functools.partial(one_rank_rank, "nccl"), 1, timeout_s=TIMEOUT_S,
                         start_method="spawn")
    return bool(res["ok"]), ("device carrier: " + res["detail"] if res["detail"] else
                             "device carrier: one step sent; a bad value raised one call later")


def check_c(steps: int, gpus: int) -> tuple[bool, str]:
    P = min(4, gpus)
    for kernels in kernel_sets():
        res = spawn_ranks(functools.partial(workload_rank, steps, "nccl", "error", kernels), P,
                          timeout_s=TIMEOUT_S, start_method="spawn")
        syncs = [s for r in res for s in r["syncs"]]
        if not all(r["exact"] for r in res) or syncs:
            return False, (f"P={P} {kernels}: exact={[r['exact'] for r in res]} "
                           f"host syncs: {syncs[:2]}")
    timed = spawn_ranks(functools.partial(timed_rank, 200, "nccl"), P, timeout_s=TIMEOUT_S,
                        start_method="spawn")
    worst = {k: max(t[k] for t in timed) for k in timed[0]}
    figures = ", ".join(f"{k} {v:.0f}" for k, v in worst.items())
    return True, (f"P={P}, device carrier, {steps} steps exact ({', '.join(kernel_sets())}); "
                  f"median µs/step (slowest rank): {figures}")


def check_d(gpus: int, late_s: float = LATE_S) -> tuple[bool, str]:
    """Over NCCL (>= 2 GPUs, the device carrier) a receive's wait on the
    main stream would hold the chain; over gloo (one GPU, the host carrier:
    a receive is a gloo receive into pinned memory) a post() that blocks the
    host shows, and a stream-side hold cannot (the CPU twin's engine-stream
    check stands in)."""
    backend = "nccl" if gpus >= 2 else "gloo"
    ok, parts = True, []
    for api, rank_fn in (("sync", late_peer_rank), ("async", late_peer_async_rank)):
        res = spawn_ranks(functools.partial(rank_fn, backend, late_s), 2, timeout_s=TIMEOUT_S,
                          start_method="spawn")
        good, detail = late_peer_verdict(api, res[0], late_s)
        ok &= good
        parts.append(detail)
    scope = ("" if backend == "nccl" else
             " (one GPU: a blocking post() shows; a main stream held by a NCCL "
             "wait needs >= 2 GPUs)")
    return ok, (f"{backend} ({carrier_over(backend)} carrier), peer {late_s:.0f} s late{scope}; "
                + "; ".join(parts))


def check_e(rows: int = 256, iters: int = 200) -> tuple[bool, str]:
    """Per step, per role, on GPU 0: host µs / device µs of each scheme
    (ppsync.checks.gpu.step_costs), every token-path call under sync debug "error"
    (a host sync raises: FAIL), the guard itself shown live first."""
    dev = device_of(0)
    if not sync_guard_live(dev):
        return False, "sync debug mode 'error' let a .item() through: no host sync can fail e"
    ok, parts = True, []
    for spec in (0, 3):
        good, detail = timing_verdict(time_schemes(rows, spec, iters, str(dev)),
                                      cuda=dev.type == "cuda")
        ok &= good
        parts.append(f"K={spec}: {detail}")
    return ok, f"no host sync; host/device µs per call, {rows} rows; " + " | ".join(parts)
