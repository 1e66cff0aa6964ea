"""Embedding ppsync in an async engine (anyio: asyncio or trio), runnable as is.

A tiny replicated scheduler and a fake sampler stand in for the engine, so
every call an engine makes is here. Run three ranks on one machine:

    torchrun --standalone --nproc-per-node 3 examples/embed_anyio.py
    torchrun --standalone --nproc-per-node 3 examples/embed_anyio.py --backend trio

or start each rank yourself, torchrun-style (RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT in the environment, or --rank, --world-size, --master-addr,
--master-port; rank 0 then hosts the store on MASTER_PORT).

The world is one PP group of P = WORLD_SIZE ranks; the last rank samples.
D, the ring depth, is SyncConfig.ring_depth, pp_size by default: a receiver's
take() at step T releases step T - D. Every rank prints one line; the tokens
and the digest of every request's output agree on every rank when every
token was delivered.
"""

from __future__ import annotations

import argparse
import datetime
import os
import zlib
from collections import deque
from dataclasses import dataclass, field
from typing import Literal

import anyio
import anyio.lowlevel
import numpy as np
import torch
import torch.distributed as dist

from ppsync import BatchView, FailureBoard, SampledStep, SyncConfig, open_rank, token_group

MAX_NUM_REQS = 8
K = 1  # num_speculative_steps: drafts per request per step; L = K + 1


@dataclass
class Request:
    req_id: int
    slot: int  # request slot index in [0, MAX_NUM_REQS)
    prompt_len: int
    max_tokens: int
    num_computed: int = 0
    last_step: int = -1  # the last step it was scheduled in
    done: bool = False
    outputs: list[int] = field(default_factory=list)


@dataclass
class Step:
    """One scheduled step: its rows' requests, and the last rank's own outputs."""

    rows: list[Request]
    view: BatchView
    outputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None


class Scheduler:
    """Replicated: every rank runs it on the same inputs (the steps' tokens), so
    every rank builds the same BatchView. A request is scheduled only on the
    steps of its lane (req_id mod D), so its tokens, released D steps later,
    are applied before it is scheduled again: the microbatching of a PP engine."""

    def __init__(self, depth: int) -> None:
        self.depth = depth
        self.free_slots = list(range(MAX_NUM_REQS))
        self.live: dict[int, Request] = {}  # slot -> request
        self.next_id = 0
        self.finished: list[Request] = []
        self.tokens = 0

    def end(self, req: Request) -> int:
        """Finish or abort ``req``; return its slot, now free for reuse."""
        req.done = True
        self.finished.append(self.live.pop(req.slot))
        self.free_slots.append(req.slot)
        return req.slot

    def apply(self, step: Step, keep: np.ndarray, tokens: torch.Tensor,
              num_sampled: torch.Tensor, num_rejected: torch.Tensor) -> list[int]:
        """Apply step T's outputs at step T + D to the rows in ``keep``
        ([num_reqs] bool); return the slots to free."""
        freed = []
        for i, req in enumerate(step.rows):
            if not keep[i]:
                continue
            req.num_computed -= int(num_rejected[i])  # roll back rejected drafts
            req.outputs += tokens[i, : int(num_sampled[i])].tolist()
            self.tokens += int(num_sampled[i])
            if len(req.outputs) >= req.max_tokens:
                freed.append(self.end(req))
        return freed

    def begin(self, t: int, accepting: bool) -> list[int]:
        """Aborts (of a decoding request, while its step is in flight), then
        arrivals. Returns the slots freed."""
        freed = [self.end(r) for r in list(self.live.values())
                 if r.req_id % 4 == 3 and r.outputs and r.last_step == t - 1]
        if accepting and t % 2 == 0 and self.free_slots:
            n = self.next_id
            self.next_id += 1
            slot = min(self.free_slots)
            self.free_slots.remove(slot)
            self.live[slot] = Request(n, slot, prompt_len=3 + 7 * n % 13, max_tokens=2 + n % 6)
        return freed

    def schedule(self, t: int) -> Step:
        rows = [r for _, r in sorted(self.live.items()) if r.req_id % self.depth == t % self.depth]
        computed = np.array([r.num_computed for r in rows], dtype=np.int64)
        prefill = np.array([r.prompt_len for r in rows], dtype=np.int64)
        # prefill in chunks of 4; a decode row computes its last token and K drafts
        scheduled = np.where(computed < prefill, np.minimum(4, prefill - computed), 1 + K)
        for r, s in zip(rows, scheduled, strict=True):
            r.num_computed += int(s)
            r.last_step = t
        view = BatchView(
            num_reqs=len(rows),
            idx_mapping_np=np.array([r.slot for r in rows], dtype=np.int64),  # [num_reqs]
            num_computed_tokens_np=computed,  # [num_reqs]
            num_scheduled_tokens_np=scheduled.astype(np.int64),  # [num_reqs]
            prefill_len_np=prefill,  # [num_reqs]
        )
        return Step(rows, view)


def sample(step: Step) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The last rank's fake sampler and drafter: (sampled_token_ids [num_reqs, L]
    int64, num_sampled [num_reqs] int32, num_rejected [num_reqs] int32,
    draft_tokens [num_reqs, K] int64)."""
    n, L = step.view.num_reqs, K + 1
    tokens = torch.full((n, L), -1, dtype=torch.int64)
    num_sampled = torch.zeros(n, dtype=torch.int32)
    num_rejected = torch.zeros(n, dtype=torch.int32)
    drafts = torch.zeros((n, K), dtype=torch.int64)
    for i, r in enumerate(step.rows):
        pos = r.prompt_len + len(r.outputs)  # position of the row's next token
        if r.num_computed < r.prompt_len:  # a non-final prefill chunk: no sample
            continue
        decoding = bool(r.outputs)
        accepted = min((r.req_id + pos) % L, r.max_tokens - len(r.outputs) - 1) if decoding else 0
        num_sampled[i] = accepted + 1
        num_rejected[i] = K - accepted if decoding else 0
        for j in range(accepted + 1):
            tokens[i, j] = (r.req_id * 1_000_003 + (pos + j) * 7919) % 50_000
        drafts[i] = torch.arange(K) + pos + accepted + 1
    return tokens, num_sampled, num_rejected, drafts


async def engine(config: SyncConfig, group: dist.ProcessGroup,
                 board: FailureBoard | Literal["group"], steps: int) -> str:
    """The engine loop of one rank; returns the line it prints."""
    D = config.depth
    sched = Scheduler(D)
    in_flight: deque[Step | None] = deque()  # the last D steps, oldest first
    draft_table = torch.zeros((MAX_NUM_REQS, K), dtype=torch.int64)  # [max_num_reqs, K]
    async with open_rank(config, group, board=board) as rank:
        # `steps` steps, then D more with nothing scheduled: leaving the block
        # waits for transfers in flight but does not deliver the last D steps.
        for t in range(steps + D):
            accepting = t < steps
            done = in_flight.popleft() if t >= D else None  # step t - D
            freed: list[int] = []
            if not rank.is_last:
                released = await rank.take(draft_table)  # step t - D; drafts scattered
                if released is not None:  # None: empty slot, or every row excluded
                    assert done is not None
                    # idx_mapping -1: no sample, or its slot was freed since the post
                    keep = released.idx_mapping.numpy() >= 0
                    freed += sched.apply(done, keep, released.sampled_tokens,
                                         released.num_sampled, released.num_rejected)
            elif done is not None and done.outputs is not None:
                # the last rank applies its own sampler output, D steps late like the
                # others, to the rows of requests not ended since
                keep = np.array([not r.done for r in done.rows], dtype=bool)
                freed += sched.apply(done, keep, *done.outputs)
            freed += sched.begin(t, accepting)
            for slot in freed:
                rank.free(slot)  # bumps the slot's generation: its rows in flight are excluded
            if not accepting:
                in_flight.append(None)
                continue  # an empty schedule: every rank skips post/publish alike
            step = sched.schedule(t)
            await anyio.lowlevel.checkpoint()  # this stage's forward pass would run here
            if rank.is_last:
                tokens, num_sampled, num_rejected, drafts = sample(step)
                step.outputs = (tokens, num_sampled, num_rejected)
                await rank.publish(step.view, SampledStep(
                    tokens, num_sampled, num_rejected, drafts))
            else:
                await rank.post(step.view)  # returns once the receive is posted
            in_flight.append(step)
    outputs = sorted((r.req_id, tuple(r.outputs)) for r in [*sched.finished, *sched.live.values()])
    digest = zlib.crc32(repr(outputs).encode())
    role = "last" if rank.is_last else "receiver"
    return (f"embed_anyio rank={dist.get_rank()} role={role} steps={steps} drained={D} "
            f"tokens={sched.tokens} ended={len(sched.finished)} board={board != 'group'} "
            f"digest={digest:08x}")


def main() -> None:
    env = os.environ.get
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rank", type=int, default=int(env("RANK", "0")))
    p.add_argument("--world-size", type=int, default=int(env("WORLD_SIZE", "1")))
    p.add_argument("--master-addr", default=env("MASTER_ADDR", "127.0.0.1"))
    p.add_argument("--master-port", type=int, default=int(env("MASTER_PORT", "29500")))
    p.add_argument("--backend", choices=["asyncio", "trio"], default="asyncio")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--timeout", type=float, default=30.0)
    args = p.parse_args()

    config = SyncConfig.build(pp_size=args.world_size, max_num_reqs=MAX_NUM_REQS,
                              num_speculative_steps=K, timeout_s=args.timeout)
    # Under torchrun the agent hosts the store and every rank is a client; it
    # outlives any rank, so a failure board can live there. Otherwise the token
    # path's default board lives in its group's store (rank 0's, here).
    agent_store = env("TORCHELASTIC_USE_AGENT_STORE") == "True"
    timeout = datetime.timedelta(seconds=args.timeout)
    store = dist.TCPStore(  # type: ignore[attr-defined]  # torch's stubs omit it
        args.master_addr, args.master_port, args.world_size,
        is_master=args.rank == 0 and not agent_store, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=args.rank, world_size=args.world_size,
                            timeout=timeout)
    pp_group = dist.new_group(list(range(args.world_size)))  # your engine's PP group
    group = token_group(pp_group, timeout_s=config.timeout_s)  # same ranks, its own group
    board: FailureBoard | Literal["group"] = FailureBoard(
        store, ranks=dist.get_process_group_ranks(group), me=dist.get_rank(),
    ) if agent_store else "group"
    print(anyio.run(engine, config, group, board, args.steps, backend=args.backend), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
