"""What the SGLang guard costs per PP message and per transfer, in µs of CPU
(``python -m ppsync.probes.sglang_guard [--reqs N] [--iters N]``).

Measures the plugin's own hooks (ppsync.compat.sglang.hooks), not a copy:

- per message: ``send_dict`` on one side and ``recv_typed_dict`` on the
  other around originals that pass the dict in memory, minus the same
  originals called bare; a batch of ``--reqs`` requests;
- per transfer: the ``irecv``/``isend`` wrapper and its ``wait()`` around a
  gloo work that has already completed (a one-rank all_reduce), minus that
  work's own wait.

SGLang's loop sends and receives one proxy and one output message per stage
per step, over a few gloo transfers each (metadata size and body, then each
tensor), so a step costs about 2 messages plus the transfers counted there.
No SGLang needed.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from ppsync.compat.sglang import hooks
from ppsync.compat.sglang.guard import GuardOptions, SglangGuard


@dataclass
class _Req:
    rid: str
    origin_input_ids: list[int]
    output_ids: list[int]
    req_pool_idx: int


@dataclass
class _Batch:
    reqs: list[_Req] = field(default_factory=list)
    forward_mode: int = 2


class _Group:
    world_size = 2
    rank_in_group = 0
    is_last_rank = False

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.cpu_group = self.device_group = group


class _Scheduler:
    def __init__(self, group: dist.ProcessGroup, reqs: int) -> None:
        self.pp_group = _Group(group)
        self.cur_batch_for_debug = _Batch([_Req(f"req-{i:032x}", list(range(40)), [7] * 20, i)
                                          for i in range(reqs)])


def _per_call_ns(call: Callable[[], object], iters: int) -> float:
    for _ in range(min(iters, 1000)):
        call()
    t0 = time.perf_counter_ns()
    for _ in range(iters):
        call()
    return (time.perf_counter_ns() - t0) / iters


def measure(reqs: int, iters: int) -> dict[str, float]:
    """µs per message (send and receive hooks, one kind) and per transfer."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1,
                                timeout=timedelta(seconds=30))
    group = dist.new_group([0], backend="gloo")
    scheduler = _Scheduler(group, reqs)
    guard = SglangGuard(stage=1, pp_size=2, group=group, options=GuardOptions())
    setattr(scheduler, "_ppsync_guard", hooks._StageState(guard))  # noqa: B010
    box: list[dict[str, Any]] = [{}]

    def send(_s: object, tensor_dict: dict[str, Any], async_send: bool = True,
             msg_type: str = "default") -> list[object]:
        box[0] = tensor_dict
        return []

    def recv(_s: object, expected_kind: str = "default") -> tuple[dict[str, Any], None]:
        return box[0], None

    def hooked() -> None:
        hooks.send_dict(send, scheduler, {}, msg_type="proxy")
        hooks.recv_typed_dict(recv, scheduler, expected_kind="proxy")

    def bare() -> None:
        send(scheduler, {}, msg_type="proxy")
        recv(scheduler, expected_kind="proxy")

    message = (_per_call_ns(hooked, iters) - _per_call_ns(bare, iters)) / 1e3
    done = dist.all_reduce(__import__("torch").zeros(1), group=group, async_op=True)
    done.wait()
    wrapped = hooks.bounded(lambda *a, **k: done, hooks.RECEIVE)

    def transfer() -> None:
        wrapped(None, 0, group).wait()

    hooks._context.guard = guard
    try:
        per_transfer = (_per_call_ns(transfer, iters) - _per_call_ns(done.wait, iters)) / 1e3
    finally:
        hooks._context.guard = None
    dist.destroy_process_group()
    return {"message_us": message, "transfer_us": per_transfer}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ppsync.probes.sglang_guard",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--reqs", type=int, default=8, help="requests in the batch")
    p.add_argument("--iters", type=int, default=20000, help="timed calls per figure")
    args = p.parse_args(argv)
    figures = measure(args.reqs, args.iters)
    print(f"SGLang guard, batch of {args.reqs} requests: "
          f"{figures['message_us']:.1f} µs per message (view made on the send side, "
          f"checked on the receive side), {figures['transfer_us']:.1f} µs per gloo transfer "
          "(wrapper and bounded wait)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
