"""What each scheme asks of torch per step, per role, counted:

    python -m ppsync.bench.dispatches [--rows 256] [--spec 0 3] [--steps 20]

A :class:`DispatchCounter` (a ``TorchDispatchMode``) sees every call that
reaches torch's dispatcher while one role's calls of one step run:

- dispatches: every call, views included;
- launches: the calls that are not views (on a GPU, each a kernel launch or
  a host-side op; views cost dispatch only);
- collectives: the frames' (or the seeds' tensors') transfers, counted at
  the transport (the loopback of ppsync.bench.loopback stands in for the
  broadcast; what it does to copy is not counted);
- host syncs: ``aten._local_scalar_dense`` (``.item()``, ``int(t)``), the
  calls that wait for a device.

Schemes: vLLM's GPU scheme as the seeds ran it (ppsync.bench.seeds' host
calls around three broadcasts, two when K = 0), ppsync's host codec and its
device codec (on CPU tensors: the same torch calls a GPU would get, streams
and events aside), each on a real :class:`TokenPath` pair in one process
(ppsync.bench.codec_cpu.path_pair). The counting hooks live here, never in
the token path. Counts are per step, averaged over ``steps`` hot steps.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch.utils._python_dispatch import TorchDispatchMode

from ppsync.bench.codec_cpu import _step_calls, in_fresh_process, path_pair
from ppsync.bench.common import fixed_step
from ppsync.bench.seeds import SeedsHostOps
from ppsync.core.token_path import TokenPath
from ppsync.schemas.config import SyncConfig

SCHEMES = ("vllm gpu (seeds)", "ppsync host", "ppsync device")
ROLES = ("receiver", "last rank")


@dataclass
class Counts:
    """Per-step counts of one role of one scheme."""

    dispatches: float = 0.0
    launches: float = 0.0
    collectives: float = 0.0
    host_syncs: float = 0.0


class DispatchCounter(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Counts the calls reaching torch's dispatcher (see the module doc)."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.paused = False
        self.dispatches = self.launches = self.collectives = self.host_syncs = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        if not self.paused:
            self.dispatches += 1
            self.launches += not func.is_view
            self.host_syncs += func.__name__.startswith("_local_scalar_dense")
        return func(*args, **(kwargs or {}))

    def collective(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn`` (a transfer) counted as one collective, its own calls not."""
        def counted(*args: Any, **kwargs: Any) -> Any:
            self.collectives += 1
            self.paused = True
            try:
                return fn(*args, **kwargs)
            finally:
                self.paused = False
        return counted

    def take(self, steps: int) -> Counts:
        """The counts so far, per step; then zero."""
        out = Counts(self.dispatches / steps, self.launches / steps,
                     self.collectives / steps, self.host_syncs / steps)
        self.dispatches = self.launches = self.collectives = self.host_syncs = 0
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
    return Counts(a.dispatches + b.dispatches, a.launches + b.launches,
                  a.collectives + b.collectives, a.host_syncs + b.host_syncs)


def _div(a: Counts, n: int) -> Counts:
    return Counts(a.dispatches / n, a.launches / n, a.collectives / n, a.host_syncs / n)


def _path_counts(config: SyncConfig, steps: int) -> dict[str, Counts]:
    counter = DispatchCounter()
    with path_pair(config) as (last, receiver):
        for path in (last, receiver):
            _count_transfers(path, counter)
        step = fixed_step(config.max_num_reqs, config.num_speculative_steps)
        return _count(_step_calls(last, receiver, step), counter, steps)


def _count_transfers(path: TokenPath, counter: DispatchCounter) -> None:
    transport = path.transport
    transport.issue = counter.collective(transport.issue)  # type: ignore[method-assign]


def _seeds_counts(rows: int, spec: int, steps: int) -> dict[str, Counts]:
    """vLLM's GPU scheme: the seeds' host calls and one collective per tensor
    (the broadcasts themselves are not run: their count is the scheme's)."""
    counter = DispatchCounter()
    ops = SeedsHostOps(fixed_step(rows, spec))
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
    ``spec``. It makes gloo pairs: call it in a process that forks no ranks
    later (``in_fresh_process``)."""
    def config(codec: str) -> SyncConfig:
        return SyncConfig.build(pp_size=2, max_num_reqs=rows, num_speculative_steps=spec,
                                timeout_s=30.0, codec=codec)
    return {
        SCHEMES[0]: _seeds_counts(rows, spec, steps),
        SCHEMES[1]: _path_counts(config("host"), steps),
        SCHEMES[2]: _path_counts(config("device"), steps),
    }


def format_table(rows: int, counts: dict[int, dict[str, dict[str, Counts]]]) -> str:
    """The per step, per role table: dispatches / launches / collectives /
    host syncs, for each K in ``counts``."""
    lines = [f"torch calls per step, per role (rows={rows}, P=2; dispatches incl. views / "
             "launches (non-view ops) / collectives / host syncs)"]
    head = f"{'scheme':<18}" + "".join(f" {f'{r}, K={k}':>22}" for k in counts for r in ROLES)
    lines.append(head)
    for scheme in SCHEMES:
        cells = []
        for k in counts:
            for role in ROLES:
                c = counts[k][scheme][role]
                cell = f"{c.dispatches:g}/{c.launches:g}/{c.collectives:g}/{c.host_syncs:g}"
                cells.append(f" {cell:>22}")
        lines.append(f"{scheme:<18}" + "".join(cells))
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
    return 0


if __name__ == "__main__":
    from ppsync.bench import dispatches

    sys.exit(dispatches.main())
