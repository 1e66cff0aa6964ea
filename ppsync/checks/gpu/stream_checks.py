"""``make gpu-check``'s checks of stream-ordered completion (f-i, and d's
async half): what only a GPU shows, since on gloo a work's future completes
when the transfer does (docs/design.md; docs/operations.md, "GPU check").

Each rank function also runs on CPU over gloo with CPU tensors, where its
logic allows: the tests' dry run (tests/checks/gpu/test_gpu_check.py). On CUDA,
"a long kernel" is ``torch.cuda._sleep`` on the current stream, so whatever
is queued behind it on any stream that waits for that stream is still
pending when the host looks.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import signal
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import torch
import torch.distributed as dist

from ppsync.bench.codec_cpu import path_pair
from ppsync.core.frame.rows import SampledStep
from ppsync.core.path.token_path import TokenPath
from ppsync.core.rules import BatchView
from ppsync.core.wire.backends import backend as backend_facts
from ppsync.core.wire.groups import token_group
from ppsync.errors import PPSyncError, RankFailed, SyncTimeout
from ppsync.harness.launcher import RankEnv, spawn_ranks
from ppsync.schemas.config import CarrierName, SyncConfig
from ppsync.services.runtime import open_rank

Result = dict[str, Any]
TIMEOUT_S = 60.0
SENTINEL_TOKEN = 7  # what the engine writes over its sampler outputs after publish
ROW_COUNTS = (1, 15, 16, 17, 63, 64, 65, 4096, 16384)
"""Check h's row counts: Triton specializes an int argument on == 1 and on
divisibility by 16, so these cross every such boundary."""


def device_of(rank: int) -> torch.device:
    """This rank's GPU (ranks share GPU 0 when there is one); CPU in the
    tests' dry run."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    dev = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    return dev


def long_kernel(dev: torch.device, seconds: float) -> None:
    """Queue about ``seconds`` of device work on the current stream (CUDA:
    a spin of ~2e9 cycles per second; the clock only has to be roughly
    right). On CPU, nothing: ops there ran before the call returned."""
    if dev.type == "cuda":
        torch.cuda._sleep(int(seconds * 2e9))  # type: ignore[no-untyped-call]


def main_stream_work(dev: torch.device) -> None:
    """Check d's engine work after the post, on the main stream only (the
    pending receive is on others), synchronized so its end is timed."""
    size = 1024 if dev.type == "cuda" else 128  # the CPU dry run: logic, not load
    x = torch.randn(size, size, device=dev)
    for _ in range(20):
        x = torch.tanh(x @ x)
    if dev.type == "cuda":
        torch.cuda.current_stream(dev).synchronize()


def decode_view(n: int) -> BatchView:
    """``n`` decode rows in slots 0..n-1, each needing a sample."""
    return BatchView(
        num_reqs=n, idx_mapping_np=np.arange(n, dtype=np.int64),
        num_computed_tokens_np=np.full(n, 10, dtype=np.int64),
        num_scheduled_tokens_np=np.ones(n, dtype=np.int64),
        prefill_len_np=np.full(n, 5, dtype=np.int64),
    )


def carrier_over(backend: str) -> CarrierName:
    """The carrier a check's token path names on a ``backend`` token group:
    a device backend (NCCL) takes device tensors only, so the frame itself
    goes on it ("device"; the host carrier is refused there); over gloo the
    default, "host" (through pinned memory; on CPU the frame is sent as it
    is: ppsync.core.codec.carriers.carrier_for)."""
    return "host" if backend_facts(backend).device_type == "cpu" else "device"


def device_config(pp_size: int, backend: str, **extra: Any) -> SyncConfig:
    """A device-codec path's configuration for a ``backend`` token group."""
    fields: dict[str, Any] = dict(pp_size=pp_size, max_num_reqs=64, num_speculative_steps=2,
                                  timeout_s=TIMEOUT_S, codec="device",
                                  carrier=carrier_over(backend))
    fields.update(extra)
    return SyncConfig.build(**fields)


# -- f) the premise: a work's future is done at enqueue ---------------------------------


def premise_rank(backend: str, env: RankEnv) -> Result:
    """A one-rank group: a broadcast issued behind a long kernel on the
    current stream. Returns what the host sees right after issuing it (the
    future's done(), is_completed()) and once the device is idle."""
    dev = device_of(0)
    group = token_group(dist.group.WORLD, timeout_s=TIMEOUT_S,  # type: ignore[arg-type]
                        backend=backend)
    buf = torch.arange(64, dtype=torch.int64, device=dev)
    dist.broadcast(buf, src=0, group=group)  # the communicator exists before the timed one
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    long_kernel(dev, 0.5)
    work = dist.broadcast(buf, src=0, group=group, async_op=True)
    assert work is not None
    future_done, completed = work.get_future().done(), work.is_completed()
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    work.wait()
    return {"future_done": future_done, "is_completed": completed,
            "is_completed_after_sync": work.is_completed()}


# -- g) the engine overwrites its sampler outputs right after publish -------------------


def step_tokens(step: int, n: int, dev: torch.device) -> torch.Tensor:
    """Step ``step``'s tokens: [n, 3] int64, distinct per step and row."""
    return (torch.arange(n * 3, dtype=torch.int64, device=dev).view(n, 3)
            + 1000 * (step + 1))


def overwrite_rank(backend: str, steps: int, env: RankEnv) -> Result:
    """Two ranks, D = 1. The last rank queues a long kernel, then its
    sampler outputs, publishes them, and at once overwrites them in place
    on the main stream (tokens = SENTINEL_TOKEN, num_sampled = 1: values the
    frame's checks accept). The receiver must get the original values, every
    step. Returns the steps whose frame carried anything else."""
    dev = device_of(env.rank)
    group = token_group(dist.group.WORLD, timeout_s=TIMEOUT_S,  # type: ignore[arg-type]
                        backend=backend)
    path = TokenPath(device_config(2, backend, ring_depth=1), group, device=dev)
    n = 8
    view = decode_view(n)
    tokens = torch.empty(n, 3, dtype=torch.int64, device=dev)
    ns = torch.empty(n, dtype=torch.int32, device=dev)
    nr = torch.zeros(n, dtype=torch.int32, device=dev)
    wrong: list[int] = []
    if path.is_last:
        for s in range(steps):
            long_kernel(dev, 0.05)  # the side stream, if it waits for main, is behind
            tokens.copy_(step_tokens(s, n, dev))  # the sampler's outputs, on main
            ns.fill_(3)
            path.publish(view, SampledStep(tokens, ns, nr))
            tokens.fill_(SENTINEL_TOKEN)  # the engine reuses its buffers at once
            ns.fill_(1)
    else:
        assert path.consume() is None  # D = 1: reserves the tail the first post fills
        for s in range(steps):
            path.post(view)
            out = path.consume()  # step s
            good = (out is not None
                    and torch.equal(out.sampled_tokens.cpu(), step_tokens(s, n, dev).cpu())
                    and bool((out.num_sampled.cpu() == 3).all()))
            if not good:
                wrong.append(s)
    path.close()
    return {"wrong_steps": wrong}


# -- h) Triton compiles once per flag combination -----------------------------------------


def compiled_variants(kernel: Any) -> int | None:
    """How many compiled variants a Triton JIT function holds, over devices:
    Triton 3.2+ keeps them in ``device_caches`` (device -> (kernel cache,
    ...)); earlier Triton in ``cache`` (device -> kernel cache). None where
    neither is laid out so (a Triton this code does not know)."""
    caches = getattr(kernel, "device_caches", None)
    if isinstance(caches, dict):
        entries = list(caches.values())
        if all(isinstance(e, tuple) and e and isinstance(e[0], dict) for e in entries):
            return sum(len(e[0]) for e in entries)
    cache = getattr(kernel, "cache", None)
    if isinstance(cache, dict) and all(isinstance(c, dict) for c in cache.values()):
        return sum(len(c) for c in cache.values())
    return None


class CheckSkipped(Exception):
    """A check that cannot run here, and why (its row reads SKIP)."""


def variant_counts(kernels: str, device: str = "cuda:0", row_counts: tuple[int, ...] = ROW_COUNTS
                   ) -> list[dict[str, int | None]]:
    """Run a published and a released step at each row count (a one-process
    path pair; the frame over a loopback copy), and after each count, the
    compiled variants of each Triton kernel ({} for torch ops)."""
    dev = torch.device(device)
    counts: list[dict[str, int | None]] = []
    kernel_fns: dict[str, Any] = {}
    if kernels == "triton":
        from ppsync.core.codec.device_kernels import triton_jit
        kernel_fns = {"pack_frame": triton_jit.pack_frame,
                      "check_release": triton_jit.check_release}
    top = max(row_counts)
    config = SyncConfig.build(pp_size=2, max_num_reqs=top, num_speculative_steps=2,
                              ring_depth=1, timeout_s=TIMEOUT_S, codec="device",
                              device_kernels=kernels)
    with path_pair(config, dev) as (last, receiver):
        assert receiver.consume() is None
        for n in row_counts:
            view = decode_view(n)
            tokens = step_tokens(0, n, dev)
            ns = torch.full((n,), 3, dtype=torch.int32, device=dev)
            nr = torch.zeros(n, dtype=torch.int32, device=dev)
            drafts = torch.zeros(n, 2, dtype=torch.int64, device=dev)
            last.publish(view, SampledStep(tokens, ns, nr, drafts))
            receiver.post(view)
            out = receiver.consume()
            assert out is not None and out.num_reqs == n
            counts.append({name: compiled_variants(fn) for name, fn in kernel_fns.items()})
    return counts


# -- i) kill -9 of the last rank: every survivor names it ---------------------------------


def kill_rank(backend: str, timeout_s: float, kill_at: int, out_dir: str, env: RankEnv) -> None:
    """P ranks, D = P; the last rank SIGKILLs itself at step ``kill_at``.
    Each rank writes ``rank<N>.json`` to ``out_dir``: the victim when it
    dies, a survivor what it caught (type, peer, message) and when
    (CLOCK_MONOTONIC: one clock for every process of the host)."""
    dev = device_of(env.rank)
    group = token_group(dist.group.WORLD, timeout_s=timeout_s,  # type: ignore[arg-type]
                        backend=backend)
    path = TokenPath(device_config(env.world_size, backend, timeout_s=timeout_s), group,
                     device=dev)
    n = 8
    view = decode_view(n)
    tokens = step_tokens(0, n, dev)
    ns = torch.full((n,), 3, dtype=torch.int32, device=dev)
    nr = torch.zeros(n, dtype=torch.int32, device=dev)
    out = Path(out_dir) / f"rank{env.rank}.json"
    caught: Result = {"rank": env.rank, "error": "", "peer": None, "message": ""}
    try:
        for t in range(100_000):  # far more than run before the kill stops them
            if path.is_last:
                if t == kill_at:
                    if dev.type == "cuda":
                        torch.cuda.synchronize(dev)  # every frame so far went out
                    out.write_text(json.dumps({"rank": env.rank, "killed": time.monotonic()}))
                    os.kill(os.getpid(), signal.SIGKILL)
                path.publish(view, SampledStep(tokens, ns, nr))
            else:
                path.consume()
                path.post(view)
    except PPSyncError as e:
        caught.update(error=type(e).__name__, peer=getattr(e, "peer", None), message=str(e))
    caught["at"] = time.monotonic()
    out.write_text(json.dumps(caught))
    path.close(drain=False)  # what an engine does on an error


def kill_verdict(out_dir: str, world: int, timeout_s: float) -> tuple[bool, str]:
    """Whether every survivor named the last rank within timeout_s + 1 s."""
    files = {r: Path(out_dir) / f"rank{r}.json" for r in range(world)}
    victim = world - 1
    if not files[victim].exists():
        return False, "the last rank never reached its kill"
    killed = json.loads(files[victim].read_text())["killed"]
    ok, parts = True, []
    for r in range(victim):
        if not files[r].exists():
            ok = False
            parts.append(f"rank {r}: nothing caught (hung or died)")
            continue
        seen = json.loads(files[r].read_text())
        after = seen["at"] - killed
        good = (seen["error"] in ("PeerLost", "SyncTimeout") and seen["peer"] == victim
                and after <= timeout_s + 1.0)
        ok &= good
        parts.append(f"rank {r}: {seen['error'] or 'no error'} peer={seen['peer']} "
                     f"{after:.1f} s after the kill")
    return ok, "; ".join(parts)


# -- d) async post does not hold the main stream --------------------------------------------


def late_peer_async_rank(backend: str, late_s: float, env: RankEnv) -> Result:
    """d through the async services: the receiver awaits post() (open_rank,
    ReceiveService.post), then queues a matmul chain on its main stream and
    times both to the chain's end, and post() to the frame's arrival, while
    the last rank publishes ``late_s`` late (as ppsync.checks.gpu.workload_checks'
    late_peer_rank)."""
    dev = device_of(env.rank)
    group = token_group(dist.group.WORLD, timeout_s=TIMEOUT_S,  # type: ignore[arg-type]
                        backend=backend)
    config = device_config(2, backend, ring_depth=1)
    view = decode_view(8)
    result: Result = {}

    async def engine() -> None:
        async with open_rank(config, group, device=dev) as rank:
            if rank.is_last:
                await anyio.sleep(late_s)  # the late peer
                await rank.publish(view, SampledStep(
                    step_tokens(0, 8, dev), torch.full((8,), 3, dtype=torch.int32, device=dev),
                    torch.zeros(8, dtype=torch.int32, device=dev)))
                return
            assert await rank.take() is None
            t0 = time.perf_counter()  # before post(): a post that blocks counts too
            await rank.post(view)
            main_stream_work(dev)
            result["main_s"] = time.perf_counter() - t0
            out = await rank.take()
            result["frame_s"] = time.perf_counter() - t0
            result["delivered"] = (out is not None and torch.equal(
                out.sampled_tokens.cpu(), step_tokens(0, 8, dev).cpu()))

    anyio.run(engine)
    return result


# -- the checks, as gpu_check's table runs them ---------------------------------------------


def premise_verdict(res: Result) -> tuple[bool, str]:
    """f's verdict: right after the call the future is done (enqueued) and
    the work is not completed (still behind the kernel), and it is once the
    device is idle. Any other answer is a NCCL whose futures mean something
    else than ppsync's completion assumes (docs/design.md)."""
    premise = bool(res["future_done"]) and not res["is_completed"]
    ok = premise and bool(res["is_completed_after_sync"])
    return ok, (f"right after a broadcast behind a 0.5 s kernel: future done={res['future_done']}, "
                f"work.is_completed()={res['is_completed']}; after a device sync "
                f"is_completed()={res['is_completed_after_sync']} (premise "
                f"{'holds' if premise else 'FALSE'}: future done at enqueue, work not completed)")


def check_f() -> tuple[bool, str]:
    (res,) = spawn_ranks(functools.partial(premise_rank, "nccl"), 1, timeout_s=TIMEOUT_S,
                         start_method="spawn")
    return premise_verdict(res)


def check_g(gpus: int, steps: int = 40) -> tuple[bool, str]:
    ok, parts = True, []
    for backend in ["gloo"] + (["nccl"] if gpus >= 2 else []):
        res = spawn_ranks(functools.partial(overwrite_rank, backend, steps), 2,
                          timeout_s=TIMEOUT_S, start_method="spawn")
        wrong = res[0]["wrong_steps"]
        ok &= not wrong
        parts.append(f"{backend} ({carrier_over(backend)} carrier): "
                     f"{steps - len(wrong)}/{steps} steps original"
                     + (f", overwritten values sent at steps {wrong[:5]}" if wrong else ""))
    if gpus < 2:
        parts.append("nccl: needs >= 2 GPUs")
    return ok, "; ".join(parts)


def variants_verdict(counts: list[dict[str, int | None]], version: str) -> tuple[bool, str]:
    """h's verdict on :func:`variant_counts`: SKIP (:class:`CheckSkipped`)
    where the variants cannot be counted on this Triton; else each kernel
    compiled after the first count and none compiled again after it."""
    first, last = counts[0], counts[-1]
    unknown = sorted(k for k, v in first.items() if v is None)
    if unknown:
        raise CheckSkipped(f"Triton {version}: cannot count the compiled variants of "
                           f"{unknown} (neither device_caches nor cache laid out as known)")
    grown = {k: f"{first[k]} -> {last[k]}" for k in first}
    return (bool(first) and first == last and all(first.values())), (
        f"compiled variants after n={ROW_COUNTS[0]} -> after n={ROW_COUNTS[-1]} "
        f"({len(ROW_COUNTS)} row counts): {grown}")


def check_h() -> tuple[bool, str]:
    import triton

    ok, detail = variants_verdict(variant_counts("triton"), triton.__version__)
    return ok, f"host carrier (the kernels are the same under either); {detail}"


def check_i(gpus: int, timeout_s: float = 5.0) -> tuple[bool, str]:
    world = min(3, gpus)
    with tempfile.TemporaryDirectory() as tmp:
        # the victim's death is a RankFailed; a survivor that hung is killed (SyncTimeout)
        with contextlib.suppress(RankFailed, SyncTimeout):
            spawn_ranks(functools.partial(kill_rank, "nccl", timeout_s, 20, tmp), world,
                        timeout_s=timeout_s + 15, start_method="spawn")
        ok, detail = kill_verdict(tmp, world, timeout_s)
    return ok, f"P={world}, device carrier, timeout_s={timeout_s}: {detail}"
