"""ppsync's own CPU per step without any collective: a single-process tight
loop over the same pieces the token path runs at a given row count.

- last rank: validate the batch view, check the sampler outputs (and drafts),
  the need-sampled mask, the idx_mapping digest, a fresh frame buffer and
  ``FrameCodec.pack`` (what ``TokenPath.publish`` does before the issue);
- receiver: the post side (validate, mask, idx_mapping copy, digest, buffer,
  generation snapshot) and the consume side (kept rows, ``FrameCodec.check``
  of a packed frame, the released arrays), as ``TokenPath.post`` / ``consume``
  do around the transfer.

This follows the core's steps by hand (the core issues a collective inside
post/publish); the in-run figure (variant c, issue and waits timed apart) is
the one measured on the real path.
"""

from __future__ import annotations

import time

import numpy as np
import torch
import torch.distributed as dist

from ppsync.bench.common import FixedStep, cpu_now, fixed_step
from ppsync.bench.model import BenchOptions, pct_us
from ppsync.core.batch import validate_batch
from ppsync.core.checks import check_sampled, check_step_drafts
from ppsync.core.frame import FrameCodec, FrameView, slot_need_words
from ppsync.core.generations import GenerationTable
from ppsync.core.mask import need_sampled_mask
from ppsync.core.recorder import FlightRecorder
from ppsync.core.released import ReleasedStep


class _Micro:
    def __init__(self, opts: BenchOptions) -> None:
        self.config = opts.sync_config(ring_depth=1)
        self.step: FixedStep = fixed_step(opts.rows, opts.spec)
        self.codec = FrameCodec(self.config)
        self.generations = GenerationTable(self.config.max_num_reqs)

    def last(self, seq: int) -> torch.Tensor:
        c, s, codec = self.config, self.step, self.codec
        view = s.view
        validate_batch(view, c.max_num_reqs)
        tokens_np, ns_np, nr_np = check_sampled(
            s.tokens, s.num_sampled, s.num_rejected, num_reqs=view.num_reqs,
            sample_width=c.sample_width, num_drafts=c.num_speculative_steps,
        )
        need = need_sampled_mask(view)
        drafts_np = None if s.drafts is None else check_step_drafts(
            s.drafts, num_reqs=view.num_reqs, num_drafts=c.num_speculative_steps)
        frame = FrameView(seq, view.num_reqs,
                          codec.idx_digest(view.idx_mapping_np, view.num_computed_tokens_np),
                          slot_need_words(view.idx_mapping_np, need),
                          view.num_computed_tokens_np)
        buf = codec.new_buffer(view.num_reqs)
        codec.pack(buf.numpy(), frame, tokens_np, ns_np, nr_np, drafts_np)
        return buf

    def receiver(self, seq: int, sent: torch.Tensor) -> ReleasedStep:
        c, view, codec = self.config, self.step.view, self.codec
        validate_batch(view, c.max_num_reqs)
        need = need_sampled_mask(view)
        idx_np = np.array(view.idx_mapping_np, dtype=np.int64)
        frame = FrameView(seq, view.num_reqs,
                          codec.idx_digest(idx_np, view.num_computed_tokens_np),
                          slot_need_words(idx_np, need),
                          view.num_computed_tokens_np.astype(np.int64))
        codec.new_buffer(view.num_reqs)  # the buffer a receive would fill
        gen_np = self.generations.snapshot(idx_np)
        # ... the transfer fills the buffer; ``sent`` stands in for it ...
        keep = need & self.generations.unchanged(idx_np, gen_np)
        buf_np = sent.numpy()
        codec.check(buf_np, frame, rank=0)
        L = c.sample_width
        rows = codec.rows(buf_np, frame.num_reqs)
        drafts = None
        if c.num_speculative_steps:
            drafts = torch.from_numpy(np.ascontiguousarray(codec.drafts(rows)))
        return ReleasedStep(
            seq=seq,
            sampled_tokens=torch.from_numpy(np.ascontiguousarray(rows[:, :L])),
            num_sampled=torch.from_numpy(rows[:, L].astype(np.int32)),
            num_rejected=torch.from_numpy(rows[:, L + 1].astype(np.int32)),
            idx_mapping=torch.from_numpy(np.where(keep, idx_np, -1)),
            draft_tokens=drafts,
            kept_np=keep,
        )


def micro_cpu(opts: BenchOptions, *, iters: int = 2000) -> tuple[float, float]:
    """(last rank, receiver) median µs of CPU time per step (this thread's,
    so another process taking the core does not count), no collective."""
    m = _Micro(opts)
    last_ns = np.zeros(iters, dtype=np.int64)
    recv_ns = np.zeros(iters, dtype=np.int64)
    for i in range(iters):
        t0 = cpu_now()
        buf = m.last(i)
        t1 = cpu_now()
        m.receiver(i, buf)
        t2 = cpu_now()
        last_ns[i], recv_ns[i] = t1 - t0, t2 - t1
    warm = iters // 10
    return pct_us(last_ns[warm:], 50), pct_us(recv_ns[warm:], 50)


def recorder_cpu(opts: BenchOptions, *, iters: int = 20000, block: int = 50) -> dict[str, float]:
    """The flight recorder's CPU per step (µs, p50 over blocks of ``block``
    steps), on (SyncConfig's default flight_events) and off (0): the calls
    TokenPath makes per step with a transfer, on the real FlightRecorder
    (last rank: issue + complete of the oldest send; receiver: consume of
    the head, with its kept-row count and wait clock, + issue). On and off
    blocks are interleaved."""
    depth = opts.pp_size
    on = opts.sync_config(ring_depth=depth).flight_events
    works = [dist.Work() for _ in range(2 * depth + 2)]
    keep = np.ones(opts.rows, dtype=bool)
    frames = [FrameView(s, opts.rows, s * 7919) for s in range(iters)]  # one per seq
    samples: dict[str, list[int]] = {"last_on": [], "last_off": [], "receiver_on": [],
                                     "receiver_off": []}
    recs = {(last, cap): FlightRecorder(cap, is_last=last, depth=depth)
            for last in (True, False) for cap in (on, 0)}
    seq = {k: 0 for k in recs}
    for b in range(iters // block):
        for cap in ((on, 0) if b % 2 else (0, on)):
            for last in (True, False):
                rec = recs[last, cap]
                s0 = seq[last, cap]
                t0 = cpu_now()
                for s in range(s0, s0 + block):
                    w = works[s % len(works)]
                    if last:
                        rec.issue(w, s, s, 0, opts.rows, opts.rows, 12345, 67890, 0)
                        if s >= depth:
                            rec.complete(works[(s - depth) % len(works)], s)
                    else:
                        if s >= depth:
                            rec.consume(frames[s - depth], s, s, keep, time.monotonic_ns())
                        rec.issue(w, s, s, s, opts.rows, opts.rows, 12345, 0, 0)
                t1 = cpu_now()
                seq[last, cap] = s0 + block
                key = f"{'last' if last else 'receiver'}_{'on' if cap else 'off'}"
                samples[key].append(t1 - t0)
    return {k: pct_us(np.array(v[len(v) // 10:], dtype=np.int64), 50) / block
            for k, v in samples.items()}
