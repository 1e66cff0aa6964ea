"""Per step, per role, on one GPU: what each scheme costs the thread that
drives the model (host µs) and the device (µs between events), for
``make gpu-check``'s check e.

Schemes: vLLM's GPU scheme (ppsync.bench.vllm_scheme' calls on
CUDA tensors; its broadcasts are not run, as in ppsync.bench.dispatches),
and the device codec with each kernel set ("torch"; "triton" where Triton
imports and runs compiled) and each carrier (host: the frame's copies to
and from pinned memory are in its figures; device), on a real
:class:`TokenPath` pair in one process (ppsync.bench.codec_cpu.path_pair:
the frame goes over a loopback copy instead of a collective). Every token-path call runs under
``torch.cuda.set_sync_debug_mode("error")``: a host sync in it fails the
check. Steps are timed one call at a time (the device is synchronized
between calls, outside the timed spans): per-call costs, not a pipeline.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from ppsync.bench.codec_cpu import path_pair
from ppsync.bench.common import fixed_step
from ppsync.bench.vllm_scheme import VllmHostOps
from ppsync.core.codec.device_kernels import triton_error
from ppsync.schemas.config import SyncConfig

Timing = dict[str, dict[str, tuple[float, float]]]
"""{scheme: {role: (host µs p50, device µs p50)}}."""


Role = tuple[str, Callable[[], object], "torch.cuda.Stream | None"]
"""(role, its call for one step, the stream its device work ends on: None
for the current one)."""


def _timed(roles: list[Role], iters: int, device: torch.device
           ) -> dict[str, tuple[float, float]]:
    """{role: (host µs, device µs) medians}, the roles' calls interleaved
    step by step as an engine makes them: host time on this thread; device
    time from an event on the current stream before the call to one on the
    role's stream after it (CUDA; a CPU dry run reports 0)."""
    cuda = device.type == "cuda"
    host: dict[str, list[float]] = {name: [] for name, _, _ in roles}
    dev: dict[str, list[float]] = {name: [] for name, _, _ in roles}
    for i in range(iters + 20):
        for name, call, stream in roles:
            if cuda:
                torch.cuda.synchronize(device)
                main = torch.cuda.current_stream(device)
                start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
                end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
                start.record(main)
                torch.cuda.set_sync_debug_mode("error")
            t0 = time.perf_counter_ns()
            try:
                call()
                t1 = time.perf_counter_ns()
            finally:
                if cuda:
                    torch.cuda.set_sync_debug_mode(0)
            if cuda:
                end.record(stream if stream is not None else main)
                torch.cuda.synchronize(device)
            if i >= 20:
                host[name].append((t1 - t0) / 1e3)
                dev[name].append(start.elapsed_time(end) * 1e3 if cuda else 0.0)
    return {name: (statistics.median(host[name]), statistics.median(dev[name]))
            for name in host}


CARRIERS = ("host", "device")
"""The carriers e times the device codec with (SyncConfig.carrier)."""


def scheme_name(kernels: str, carrier: str) -> str:
    """A device-codec scheme's name in :data:`Timing`."""
    return f"ppsync device/{kernels}/{carrier} carrier"


def time_schemes(rows: int, spec: int, iters: int, device: str = "cuda:0") -> Timing:
    """Every scheme's (host µs, device µs) per role on ``device`` (GPU 0;
    "cpu": the tests' dry run, Triton in its interpreter where it imports;
    there both carriers send the frame as it is)."""
    dev = torch.device(device)
    step = fixed_step(rows, spec).to(dev)
    vllm = VllmHostOps(step, dev)
    out: Timing = {"vllm gpu": _timed([
        ("last rank", vllm.last_before, None),
        ("receiver", lambda: vllm.receiver_after(vllm.receiver_before()), None)], iters, dev)}
    sets = ["torch"] + (["triton"] if triton_error() is None else [])
    for kernels, carrier in ((k, c) for k in sets for c in CARRIERS):
        config = SyncConfig.build(pp_size=2, max_num_reqs=rows, num_speculative_steps=spec,
                                  timeout_s=30.0, codec="device", device_kernels=kernels,
                                  carrier=carrier)
        with path_pair(config, dev) as (last, receiver):
            def publish() -> object:
                return last.publish(step.view, step.sampled())

            def take_post() -> object:
                receiver.consume()
                return receiver.post(step.view)

            last_side, recv_side = (getattr(p.codec, "side", None) for p in (last, receiver))
            out[scheme_name(kernels, carrier)] = _timed([
                ("last rank", publish, last_side), ("receiver", take_post, recv_side)],
                iters, dev)
    return out


def format_timing(timing: Timing) -> str:
    """One line per scheme: host / device µs per role."""
    return "; ".join(f"{scheme}: " + ", ".join(f"{role} {h:.0f}/{d:.0f}"
                                               for role, (h, d) in roles.items())
                     for scheme, roles in timing.items())


def sync_guard_live(device: torch.device) -> bool:
    """Whether ``torch.cuda.set_sync_debug_mode("error")`` catches a host
    sync here (a ``.item()``): without that, a check that relies on it
    could not fail. True on CPU (nothing to catch: the dry run)."""
    if device.type != "cuda":
        return True
    probe = torch.ones(1, device=device)
    torch.cuda.set_sync_debug_mode("error")
    try:
        probe.item()
    except RuntimeError:
        return True
    finally:
        torch.cuda.set_sync_debug_mode(0)
    return False


def timing_verdict(timing: Timing, *, cuda: bool) -> tuple[bool, str]:
    """Check e's verdict on :func:`time_schemes`' figures: every scheme
    (vLLM's and each device kernel set) timed for both roles, each host
    figure > 0 and, on CUDA, each device figure > 0 (events that recorded
    nothing would read 0). A host sync in a token-path call raised already."""
    bad = [f"{scheme} {role}" for scheme, roles in timing.items()
           for role, (host, dev) in roles.items() if host <= 0 or (cuda and dev <= 0)]
    roles_ok = all(set(roles) == {"last rank", "receiver"} for roles in timing.values())
    schemes_ok = "vllm gpu" in timing and all(
        any(k.startswith("ppsync device/") and k.endswith(f"/{c} carrier") for k in timing)
        for c in CARRIERS)
    if not (roles_ok and schemes_ok):
        return False, f"schemes or roles missing: {sorted(timing)}"
    if bad:
        return False, f"no time measured for {', '.join(bad)}"
    return True, format_timing(timing)
