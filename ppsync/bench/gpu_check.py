"""``make gpu-check``: the device path on a GPU machine, as one command.

    python -m ppsync.bench.gpu_check [--steps N]

Checks, each in fresh rank processes (spawned: CUDA does not survive a fork):

a) two ranks sharing GPU 0 over gloo with CUDA tensors through the device
   codec: the whole synthetic workload, exact delivery; every token-path call
   runs under ``torch.cuda.set_sync_debug_mode`` and any host sync it makes
   fails the check. gloo stages CUDA tensors through the host in its own
   worker threads (its sender synchronizes its copy stream there), so over
   gloo the mode is "warn" and only warnings raised in the calling thread,
   i.e. by ppsync's own calls, count; over NCCL (b, c) it is "error".
b) a one-rank NCCL token group: a valid step, then a step with a bad
   num_sampled whose BatchError comes at the next call (deferred verdict).
c) with >= 2 GPUs: P = min(4, GPUs) ranks over NCCL, the workload with exact
   delivery, then the fused frame (the token path, ring depth 1) timed
   against one raw NCCL broadcast of the same words and vLLM's scheme
   (tokens, counts, drafts: three broadcasts); median µs per step.
d) a receive pending on a late peer (the last rank publishes 3 s late) does
   not hold the receiver's main stream: work queued on it after post()
   completes long before the frame arrives (NCCL with >= 2 GPUs, else gloo),
   through the sync API (TokenPath.post) and the async services (open_rank,
   ReceiveService.post).
e) per step, per role, on GPU 0: host µs on the calling thread and device µs
   between events for vLLM's GPU scheme, the device codec
   with torch ops and with Triton (ppsync.bench.gpu_steps), K = 0 and 3,
   every token-path call under sync debug "error".

f) the premise of stream-ordered completion, printed: on a one-rank NCCL
   group, a broadcast issued behind a long kernel on the current stream:
   its future's done() and work.is_completed() right after the call
   (expected: done at enqueue, not completed).
g) the engine overwrites its sampler tensors in place right after each
   publish (a long kernel before it, so a side stream would still be
   behind): receivers get the original values every step (two ranks on
   GPU 0 over gloo; over NCCL with >= 2 GPUs).
h) Triton's compiled variants of each kernel stay flat across row counts
   1, 15, 16, 17, 63, 64, 65, 4096, 16384 (SKIP without Triton).
i) with >= 2 GPUs: the last rank SIGKILLs itself over NCCL; every survivor
   raises an error naming it within timeout_s + 1 s.
(f-i and d's async half: ppsync.bench.gpu_stream_checks.)

a and c run the workload once per device kernel set (torch ops; Triton,
compiled, where it imports: run with TRITON_INTERPRET unset or 0).

Prints one table; exits 0 when every check passed, 1 when any failed, and 2
without running anything where there is no CUDA device (a check that ran
nothing must not read as a pass). Each check is bounded; the whole run
takes a few minutes and at most 8 (``make gpu-check`` also wraps it in
``timeout 480``).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import torch
import torch.distributed as dist

from ppsync.bench.codec_cpu import in_fresh_process
from ppsync.bench.gpu_steps import format_timing, time_schemes
from ppsync.bench.gpu_stream_checks import (
    check_f,
    check_g,
    check_h,
    check_i,
    decode_view,
    late_peer_async_rank,
)
from ppsync.core.device_kernels import triton_error
from ppsync.core.groups import token_group
from ppsync.core.token_path import TokenPath
from ppsync.errors import BatchError
from ppsync.harness.driver import run_sync_rank, workload_config
from ppsync.harness.launcher import RankEnv, spawn_ranks
from ppsync.schemas.config import SyncConfig
from ppsync.schemas.report import RankReport

TIMEOUT_S = 60.0
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


def _exact(report: RankReport) -> bool:
    clean = (report.lost, report.stale, report.duplicated, report.corrupt) == (0, 0, 0, 0)
    if report.role == "last":
        return clean and report.rows_sent > 0
    return clean and report.rows_delivered == report.rows_expected > 0


def _config(pp_size: int, **extra: Any) -> SyncConfig:
    return SyncConfig.build(pp_size=pp_size, max_num_reqs=64, num_speculative_steps=2,
                            timeout_s=TIMEOUT_S, codec="device", **extra)


def _device(rank: int) -> torch.device:
    """This rank's GPU (ranks share GPU 0 when there is one); CPU in the
    tests' dry run, where there is no CUDA."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    dev = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    return dev


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _workload_rank(steps: int, backend: str, mode: str, kernels: str, env: RankEnv) -> Result:
    dev = _device(env.rank)
    config = _config(env.world_size, device_kernels=kernels)
    group = token_group(dist.group.WORLD, timeout_s=TIMEOUT_S,  # type: ignore[arg-type]
                        backend=backend)
    path = TokenPath(config, group, device=dev)
    assert path.codec.device_kernels_name == kernels
    found: list[str] = []
    report = run_sync_rank(path, workload_config(config, steps=steps, seed=11),
                           hot=_hot(mode, found))
    return {"exact": _exact(report), "syncs": found[:3], "report": report.model_dump()}


def _one_rank_nccl(backend: str, env: RankEnv) -> Result:
    dev = _device(0)
    group = token_group(dist.group.WORLD, timeout_s=TIMEOUT_S,  # type: ignore[arg-type]
                        backend=backend)
    path = TokenPath(_config(1), group, device=dev)
    view = decode_view(4)
    tokens = torch.arange(12, device=dev, dtype=torch.int64).view(4, 3)
    ns = torch.full((4,), 3, dtype=torch.int32, device=dev)
    nr = torch.zeros(4, dtype=torch.int32, device=dev)
    found: list[str] = []
    with no_host_sync("error", found):
        path.publish(view, tokens, ns, nr)
        path.publish(view, tokens, ns + 2, nr)  # num_sampled 5 > w = 3: sent, flagged
    _sync(dev)  # let the events complete: the next call reads the verdict
    try:
        path.publish(view, tokens, ns, nr)
        deferred = "no BatchError at the next call"
    except BatchError as e:
        deferred = "" if "num_sampled[0] = 5 outside [0, w = 3]" in str(e) else str(e)
    path.close()
    return {"ok": not deferred and not found, "detail": deferred or "; ".join(found)}


def _timed_rank(iters: int, backend: str, env: RankEnv) -> Result:
    """The fused frame vs one raw broadcast vs vLLM's scheme's three broadcasts,
    interleaved, over NCCL; median µs per step as seen by this rank."""
    dev = _device(env.rank)
    P, rows, K = env.world_size, 256, 2
    L = K + 1
    nccl = token_group(dist.group.WORLD, timeout_s=TIMEOUT_S,  # type: ignore[arg-type]
                       backend=backend)
    config = SyncConfig.build(pp_size=P, max_num_reqs=rows, num_speculative_steps=K,
                              ring_depth=1, timeout_s=TIMEOUT_S, codec="device")
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
            path.publish(view, tokens, ns, nr, drafts)
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


def _late_peer_rank(backend: str, late_s: float, env: RankEnv) -> Result:
    dev = _device(env.rank)
    group = token_group(dist.group.WORLD, timeout_s=TIMEOUT_S,  # type: ignore[arg-type]
                        backend=backend)
    path = TokenPath(_config(2, ring_depth=1), group, device=dev)
    view = decode_view(8)
    if path.is_last:
        time.sleep(late_s)  # the late peer
        tokens = torch.arange(24, device=dev, dtype=torch.int64).view(8, 3)
        path.publish(view, tokens, torch.full((8,), 3, dtype=torch.int32, device=dev),
                     torch.zeros(8, dtype=torch.int32, device=dev))
        path.close()
        return {}
    assert path.consume() is None
    path.post(view)
    t0 = time.perf_counter()
    x = torch.randn(1024, 1024, device=dev)
    for _ in range(20):
        x = torch.tanh(x @ x)
    if dev.type == "cuda":  # the main stream only: the pending receive is on others
        torch.cuda.current_stream(dev).synchronize()
    main_s = time.perf_counter() - t0
    out = path.consume()
    got = None if out is None else out.sampled_tokens.cpu().flatten().tolist()
    path.close()
    return {"main_s": main_s, "delivered": got == list(range(24))}


def _run(name: str, fn: Callable[[], tuple[bool, str]]) -> tuple[str, str, str, float]:
    t0 = time.perf_counter()
    try:
        ok, detail = fn()
        status = "PASS" if ok else "FAIL"
    except Exception as e:  # a check that raised failed; the others still run
        status, detail = "FAIL", f"{type(e).__name__}: {e}"[:300]
    return name, status, detail, time.perf_counter() - t0


def check_a(steps: int) -> tuple[bool, str]:
    details, ok = [], True
    for kernels in kernel_sets():
        res = spawn_ranks(functools.partial(_workload_rank, steps, "gloo", "warn", kernels), 2,
                          timeout_s=TIMEOUT_S, start_method="spawn")
        syncs = [s for r in res for s in r["syncs"]]
        rows = res[0]["report"]["rows_delivered"]
        good = all(r["exact"] for r in res) and not syncs
        ok &= good
        details.append(f"{kernels}: {steps} steps, {rows} rows delivered exactly" if good else
                       f"{kernels}: exact={[r['exact'] for r in res]} host syncs: {syncs[:2]}")
    return ok, "; ".join(details)


def kernel_sets() -> list[str]:
    """The device kernel sets this machine runs compiled: torch ops, and
    Triton where it imports (TRITON_INTERPRET unset or 0 here)."""
    return ["torch"] + (["triton"] if triton_error() is None else [])


def check_b() -> tuple[bool, str]:
    (res,) = spawn_ranks(functools.partial(_one_rank_nccl, "nccl"), 1, timeout_s=TIMEOUT_S,
                         start_method="spawn")
    return bool(res["ok"]), res["detail"] or "one step sent; a bad value raised one call later"


def check_c(steps: int, gpus: int) -> tuple[bool, str]:
    P = min(4, gpus)
    for kernels in kernel_sets():
        res = spawn_ranks(functools.partial(_workload_rank, steps, "nccl", "error", kernels), P,
                          timeout_s=TIMEOUT_S, start_method="spawn")
        syncs = [s for r in res for s in r["syncs"]]
        if not all(r["exact"] for r in res) or syncs:
            return False, (f"P={P} {kernels}: exact={[r['exact'] for r in res]} "
                           f"host syncs: {syncs[:2]}")
    timed = spawn_ranks(functools.partial(_timed_rank, 200, "nccl"), P, timeout_s=TIMEOUT_S,
                        start_method="spawn")
    worst = {k: max(t[k] for t in timed) for k in timed[0]}
    figures = ", ".join(f"{k} {v:.0f}" for k, v in worst.items())
    return True, (f"P={P}, {steps} steps exact ({', '.join(kernel_sets())}); median µs/step "
                  f"(slowest rank): {figures}")


def check_d(gpus: int) -> tuple[bool, str]:
    backend = "nccl" if gpus >= 2 else "gloo"
    ok, parts = True, []
    for api, rank_fn in (("sync", _late_peer_rank), ("async", late_peer_async_rank)):
        res = spawn_ranks(functools.partial(rank_fn, backend, 3.0), 2, timeout_s=TIMEOUT_S,
                          start_method="spawn")
        main_s, delivered = res[0]["main_s"], res[0]["delivered"]
        ok &= main_s < 1.5 and delivered
        parts.append(f"{api}: main stream done {main_s:.2f} s after post(), "
                     f"delivered={delivered}")
    return ok, f"{backend}, peer 3 s late; " + "; ".join(parts)


def check_e() -> tuple[bool, str]:
    """Per step, per role, on GPU 0: host µs / device µs of each scheme
    (ppsync.bench.gpu_steps), every token-path call under sync debug "error"."""
    parts = []
    for spec in (0, 3):
        timing = in_fresh_process(time_schemes, 256, spec, 200)
        parts.append(f"K={spec}: {format_timing(timing)}")
    return True, "host/device µs per call, 256 rows; " + " | ".join(parts)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ppsync.bench.gpu_check",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=1000, help="workload steps in a and c")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print(f"gpu-check: not run: no CUDA device (torch {torch.__version__}, "
              "torch.cuda.is_available() is False). It needs one GPU, two or more for "
              "check c, and a CUDA build of torch in the venv.", file=sys.stderr)
        return 2
    gpus = torch.cuda.device_count()
    rows = [
        _run("a) 2 ranks on GPU 0, gloo, device codec", lambda: check_a(args.steps)),
        _run("b) 1-rank NCCL token group", check_b),
        _run(f"c) P=min(4, {gpus}) ranks over NCCL", lambda: check_c(args.steps, gpus))
        if gpus >= 2 else ("c) P ranks over NCCL", "SKIP", f"{gpus} GPU: needs >= 2", 0.0),
        _run("d) late peer, main stream not held", lambda: check_d(gpus)),
        _run("e) per step: vLLM's scheme vs device/torch vs device/triton", check_e),
        _run("f) 1-rank NCCL: future done vs is_completed", check_f),
        _run("g) overwrite after publish, receivers get originals", lambda: check_g(gpus)),
        _run("h) Triton variants flat across row counts", check_h)
        if triton_error() is None else ("h) Triton variants flat across row counts", "SKIP",
                                        f"Triton cannot be loaded ({triton_error()})", 0.0),
        _run("i) kill -9 of the last rank over NCCL", lambda: check_i(gpus))
        if gpus >= 2 else ("i) kill -9 of the last rank over NCCL", "SKIP",
                           f"{gpus} GPU: needs >= 2", 0.0),
    ]
    width = max(len(r[0]) for r in rows)
    print(f"{'check':<{width}}  result  {'s':>5}  detail")
    for name, status, detail, secs in rows:
        print(f"{name:<{width}}  {status:<6}  {secs:5.1f}  {detail}")
    print(f"torch {torch.__version__}, {gpus} x {torch.cuda.get_device_name(0)}")
    return 1 if any(r[1] == "FAIL" for r in rows) else 0


if __name__ == "__main__":
    # through the package name, so spawned ranks unpickle the targets by it
    from ppsync.bench import gpu_check

    sys.exit(gpu_check.main())
