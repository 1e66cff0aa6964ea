"""What each scheme asks of torch per step, per role, counted:

    python -m ppsync.bench.dispatches [--rows 256] [--spec 0 3] [--steps 20]

A :class:`DispatchCounter` (a ``TorchDispatchMode``) sees every call that
reaches torch's dispatcher while one role's calls of one step run:

- dispatches: every call, views included;
- launches: the calls that are not views (on a GPU, each a kernel launch or
  a host-side op; views cost dispatch only);
- collectives: the frames' (or vLLM's scheme's tensors') transfers, counted at
  the transport (the loopback of ppsync.bench.loopback stands in for the
  broadcast; what it does to copy is not counted);
- host syncs: ``aten._local_scalar_dense`` (``.item()``, ``int(t)``), the
  calls that wait for a device;
- Triton launches: the device kernels' launches (each kernel object of the
  Triton set wrapped here; what Triton's interpreter does with torch while
  it runs a kernel on CPU tensors is not counted: compiled, it is one launch);
- kernels: the compute kernels a GPU would run: Triton launches and the
  launches that neither allocate (``empty``) nor copy (``copy_``, ``_to_copy``);
- calls: dispatches + Triton launches + collectives, what the issue's
  targets compare (each costs host time on the thread that drives the model).

Schemes: vLLM's GPU scheme (ppsync.bench.vllm_scheme' host
calls around three broadcasts, two when K = 0), ppsync's host codec and its
device codec with each kernel set (torch ops; Triton, in its interpreter:
on CPU tensors the same calls a GPU would get, streams and events aside),
each on a real :class:`TokenPath` pair in one process
(ppsync.bench.codec_cpu.path_pair). The counting hooks live here, never in
the token path. Counts are per step, averaged over ``steps`` hot steps.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch.utils._python_dispatch import TorchDispatchMode

from ppsync.bench.codec_cpu import _step_calls, path_pair
from ppsync.bench.common import fixed_step
from ppsync.bench.vllm_scheme import VllmHostOps
from ppsync.core.codec.device_kernels import triton_error
from ppsync.core.path.token_path import TokenPath
from ppsync.harness.fresh import in_fresh_process
from ppsync.schemas.bench import Target
from ppsync.schemas.config import SyncConfig

SCHEMES = ("vllm gpu", "ppsync host", "ppsync device/torch", "ppsync device/triton")
ROLES = ("receiver", "last rank")


@dataclass
class Counts:
    """Per-step counts of one role of one scheme."""

    dispatches: float = 0.0
    launches: float = 0.0
    collectives: float = 0.0
    host_syncs: float = 0.0
    triton: float = 0.0
    kernels: float = 0.0

    @property
    def calls(self) -> float:
        """Torch dispatches, Triton launches and collectives."""
        return self.dispatches + self.triton + self.collectives


_NOT_COMPUTE = ("empty", "copy_", "_to_copy")
"""Launches that allocate or copy (aten op names, overload aside)."""


class DispatchCounter(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Counts the calls reaching torch's dispatcher (see the module doc)."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.paused = False
        self.counts = Counts()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        if not self.paused:
            c = self.counts
            c.dispatches += 1
            if not func.is_view:
                c.launches += 1
                c.kernels += func.__name__.split(".")[0] not in _NOT_COMPUTE
            c.host_syncs += func.__name__.startswith("_local_scalar_dense")
        return func(*args, **(kwargs or {}))

    def _uncounted(self, fn: Callable[..., Any], *fields: str) -> Callable[..., Any]:
        """``fn`` counted once in each of ``fields``; the torch calls it makes not."""
        def counted(*args: Any, **kwargs: Any) -> Any:
            for field in fields:
                setattr(self.counts, field, getattr(self.counts, field) + 1)
            self.paused = True
            try:
                return fn(*args, **kwargs)
            finally:
                self.paused = False
        return counted

    def collective(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn`` (a transfer) counted as one collective, its own calls not."""
        return self._uncounted(fn, "collectives")

    def triton_kernel(self, kernel: Any) -> Any:
        """A Triton kernel whose launches (``kernel[grid](...)``) are counted,
        each a Triton launch and a compute kernel."""
        counter = self

        class Counted:
            def __getitem__(self, grid: Any) -> Callable[..., Any]:
                return counter._uncounted(kernel[grid], "triton", "kernels")

        return Counted()

    def take(self, steps: int) -> Counts:
        """The counts so far, per step; then zero."""
        out = _div(self.counts, steps)
        self.counts = Counts()
        return out


def _count(calls: tuple[Callable[[], object], Callable[[], object]], counter: DispatchCounter,
           steps: int) -> dict[str, Counts]:
    """Per-step counts of (last rank's, receiver's) calls over ``steps`` steps,
    after as many warm-up steps."""
    last_call, receiver_call = calls
    for _ in range(steps):
        last_call()
        receiver_call()
    last_n = receiver_n = Counts()
    with counter:
        counter.take(1)
        for _ in range(steps):
            last_call()
            last_n = _add(last_n, counter.take(1))
            receiver_call()
            receiver_n = _add(receiver_n, counter.take(1))
    return {"last rank": _div(last_n, steps), "receiver": _div(receiver_n, steps)}


def _add(a: Counts, b: Counts) -> Counts:
    return Counts(**{f: getattr(a, f) + getattr(b, f) for f in _FIELDS})


def _div(a: Counts, n: int) -> Counts:
    return Counts(**{f: getattr(a, f) / n for f in _FIELDS})


_FIELDS = tuple(Counts.__dataclass_fields__)


def _path_counts(config: SyncConfig, steps: int) -> dict[str, Counts]:
    counter = DispatchCounter()
    with path_pair(config) as (last, receiver):
        for path in (last, receiver):
            _count_transfers(path, counter)
            kernels = getattr(path.codec, "device_kernels", None)
            if kernels is not None and kernels.name == "triton":
                kernels.pack_kernel = counter.triton_kernel(kernels.pack_kernel)
                kernels.release_kernel = counter.triton_kernel(kernels.release_kernel)
        step = fixed_step(config.max_num_reqs, config.num_speculative_steps)
        return _count(_step_calls(last, receiver, step), counter, steps)


def _count_transfers(path: TokenPath, counter: DispatchCounter) -> None:
    transport = path.transport
    transport.issue = counter.collective(transport.issue)  # type: ignore[method-assign]


def _vllm_counts(rows: int, spec: int, steps: int) -> dict[str, Counts]:
    """vLLM's GPU scheme: vLLM's scheme's host calls and one collective per tensor
    (the broadcasts themselves are not run: their count is the scheme's)."""
    counter = DispatchCounter()
    ops = VllmHostOps(fixed_step(rows, spec))
    transfer = counter.collective(lambda bufs: None)

    def last() -> None:
        for t in ops.last_before():
            transfer(t)

    def receiver() -> None:
        bufs = ops.receiver_before()
        for t in bufs:
            transfer(t)
        ops.receiver_after(bufs)

    return _count((last, receiver), counter, steps)


def count_all(rows: int, spec: int, steps: int) -> dict[str, dict[str, Counts]]:
    """{scheme: {role: per-step counts}} for every scheme at ``rows``, K =
    ``spec`` (the Triton set where Triton imports, in its interpreter). It
    makes gloo pairs: call it in a process that forks no ranks later
    (``in_fresh_process``), and that has not imported Triton yet."""
    os.environ.setdefault("TRITON_INTERPRET", "1")  # CPU tensors: before Triton's import

    def config(codec: str, kernels: str = "auto") -> SyncConfig:
        return SyncConfig.build(pp_size=2, max_num_reqs=rows, num_speculative_steps=spec,
                                timeout_s=30.0, codec=codec,
                                device_kernels=kernels)
    out = {
        SCHEMES[0]: _vllm_counts(rows, spec, steps),
        SCHEMES[1]: _path_counts(config("host"), steps),
        SCHEMES[2]: _path_counts(config("device", "torch"), steps),
    }
    if triton_error() is None:
        out[SCHEMES[3]] = _path_counts(config("device", "triton"), min(steps, 5))
    return out


def call_targets(counts: dict[str, dict[str, Counts]]) -> list[Target]:
    """The bench targets for one K's counts (reported, never asserted):
    the Triton device codec's calls per role at most vLLM's scheme's, at
    most 2 compute kernels, 1 collective and no host sync; the torch-op
    device codec's calls at most twice vLLM's scheme's."""
    vllm = counts[SCHEMES[0]]
    rows: list[tuple[str, float, float]] = []
    triton = counts.get(SCHEMES[3])
    for role in ROLES:
        if triton is not None:
            c = triton[role]
            rows += [(f"triton calls {role} / vLLM's", c.calls / vllm[role].calls, 1.0),
                     (f"triton compute kernels {role}", c.kernels, 2.0),
                     (f"triton collectives {role}", c.collectives, 1.0),
                     (f"triton host syncs {role}", c.host_syncs, 0.0)]
        torch_calls = counts[SCHEMES[2]][role].calls
        rows.append((f"torch-op calls {role} / vLLM's", torch_calls / vllm[role].calls, 2.0))
    return [Target(name=n, value=v, limit=lim, met=v <= lim) for n, v, lim in rows]


def format_table(rows: int, counts: dict[int, dict[str, dict[str, Counts]]]) -> str:
    """The per step, per role table: calls = dispatches + Triton launches +
    collectives, then dispatches / launches / Triton launches / compute
    kernels / collectives / host syncs, for each K in ``counts``."""
    lines = [f"torch calls per step, per role (rows={rows}, P=2): calls = dispatches + "
             "Triton launches + collectives; then dispatches incl. views / launches "
             "(non-view ops) / Triton launches / compute kernels / collectives / host syncs"]
    head = f"{'scheme':<21}" + "".join(f" {f'{r}, K={k}':>26}" for k in counts for r in ROLES)
    lines.append(head)
    for scheme in SCHEMES:
        if any(scheme not in counts[k] for k in counts):
            lines.append(f"{scheme:<21} (not run: Triton cannot be loaded here)")
            continue
        cells = []
        for k in counts:
            for role in ROLES:
                c = counts[k][scheme][role]
                cell = (f"{c.calls:g}: {c.dispatches:g}/{c.launches:g}/{c.triton:g}/"
                        f"{c.kernels:g}/{c.collectives:g}/{c.host_syncs:g}")
                cells.append(f" {cell:>26}")
        lines.append(f"{scheme:<21}" + "".join(cells))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ppsync.bench.dispatches",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--spec", type=int, nargs="+", default=[0, 3])
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args(argv)
    # each in a fresh process: no gloo pair lives in a process that later forks ranks
    counts = {k: in_fresh_process(count_all, args.rows, k, args.steps) for k in args.spec}
    print(format_table(args.rows, counts))
    for k, by_scheme in counts.items():
        print(f"targets, K={k}:")
        for t in call_targets(by_scheme):
            print(f"  {t.name:<40} {t.value:>6.2f} <= {t.limit:<4g} "
                  f"{'met' if t.met else 'MISSED'}")
    return 0


if __name__ == "__main__":
    from ppsync.bench import dispatches

    sys.exit(dispatches.main())
