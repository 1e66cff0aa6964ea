"""The flight recorder's own CPU per step, on the real FlightRecorder.

ppsync's own CPU per step on the whole path is measured on the real
TokenPath (ppsync.bench.codec_cpu.path_cpu; ``python -m
ppsync.bench.codec_cpu --phases`` splits it by phase), never on a copy of
the path's steps, which would drift from the code it claims to measure.
"""

from __future__ import annotations

import time

import numpy as np
import torch.distributed as dist

from ppsync.bench.common import cpu_now
from ppsync.bench.stats import pct_us
from ppsync.core.frame import FrameView
from ppsync.core.recorder.flight import FlightRecorder
from ppsync.schemas.bench import BenchOptions


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
                            rec.consume(frames[s - depth], s, s, keep, opts.rows,
                                        time.monotonic_ns())
                        rec.issue(w, s, s, s, opts.rows, opts.rows, 12345, 0, 0)
                t1 = cpu_now()
                seq[last, cap] = s0 + block
                key = f"{'last' if last else 'receiver'}_{'on' if cap else 'off'}"
                samples[key].append(t1 - t0)
    return {k: pct_us(np.array(v[len(v) // 10:], dtype=np.int64), 50) / block
            for k, v in samples.items()}
