"""What the heartbeats cost, and how regular they are under load:

    python -m ppsync.probes.heartbeat_cost [--pp-size 3] [--seconds 20] [--load 2] [--step-ms 0]

P local gloo ranks run the synthetic workload through the synchronous
token path for ``--seconds``, with a failure board in the launcher's store
(every rank's watcher thread beats about once a second and reads its peers'
beats: ppsync.core.wire.rank_watch), beside ``--load`` busy processes. Then
the same run without a board (no beat, no read). Per rank: steps per
second in each run, the store calls its board made per second (counted at
the store), the watcher thread's CPU time per second and per step. Rank 0
also reads every rank's beat key every 10 ms: the intervals between the
beats it saw change (1 s when regular) are the jitter a ``silent_s`` must
outlast.
"""

from __future__ import annotations

import argparse
import functools
import multiprocessing as mp
import sys
import threading
import time
from collections import Counter
from typing import Any, cast

import numpy as np
import torch
import torch.distributed as dist
from torch._C._distributed_c10d import Store

from ppsync.bench.common import world_group
from ppsync.core.path.token_path import TokenPath
from ppsync.core.wire.board import FailureBoard
from ppsync.core.wire.groups import token_group
from ppsync.harness.driver import StepLoop, outputs, workload_config
from ppsync.harness.launcher import RankEnv, spawn_ranks
from ppsync.schemas.config import SyncConfig

WATCH_EVERY_S = 0.01


class _Counting:
    """A store that counts the calls made through it (the board's)."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.calls: Counter[str] = Counter()

    def __getattr__(self, name: str) -> Any:
        real = getattr(self.store, name)

        def call(*args: Any, **kwargs: Any) -> Any:
            self.calls[name] += 1
            return real(*args, **kwargs)

        return call


def _thread_cpu_s(thread: threading.Thread) -> float:
    assert thread.ident is not None
    return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))


def _observe(store: Store, keys: list[str], stop: threading.Event,
             gaps: list[float]) -> None:
    """Read every rank's beat (``keys``) every WATCH_EVERY_S, through the
    uncounted store; note the time between changes."""
    last: dict[int, tuple[bytes, float]] = {}
    ranks = list(range(len(keys)))
    while not stop.wait(WATCH_EVERY_S):
        try:
            values = store.multi_get(keys)
        except RuntimeError:  # a key not written yet
            continue
        now = time.monotonic()
        for r, v in zip(ranks, values, strict=True):
            seen = last.get(r)
            if seen is None or seen[0] != v:
                if seen is not None:
                    gaps.append(now - seen[1])
                last[r] = (bytes(v), now)


def _rank(pp_size: int, seconds: float, step_ms: float, env: RankEnv) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for with_board in (True, False):
        # a group per run: the first run's path closes with its transfers in
        # flight, and a group whose path did so is refused for a new one
        group = token_group(world_group(), timeout_s=60.0)
        config = SyncConfig.build(pp_size=pp_size, max_num_reqs=64, num_speculative_steps=2,
                                  timeout_s=60.0)
        counting = _Counting(env.store)
        board = (FailureBoard(cast(Store, counting), ranks=list(range(pp_size)), me=env.rank)
                 if with_board else None)
        path = TokenPath(config, group, board=board)
        loop = StepLoop(workload_config(config, steps=10**9, seed=1), path.is_last, path.rank)
        stop, gaps = threading.Event(), list[float]()
        observer = None
        if with_board and env.rank == 0:
            assert board is not None
            keys = [board._beat_key(r) for r in range(pp_size)]
            observer = threading.Thread(target=_observe, args=(env.store, keys, stop, gaps),
                                        daemon=True)
            observer.start()
        cpu0, calls0 = _thread_cpu_s(path.watcher._thread), sum(counting.calls.values())
        start = time.monotonic()
        t = 0
        while True:  # every rank runs the same number of steps: rank 0 decides when
            if t % 50 == 0:
                flag = torch.tensor([int(time.monotonic() - start >= seconds)])
                dist.broadcast(flag, 0, group=group)
                if flag.item():
                    break
            if step_ms:
                time.sleep(step_ms / 1e3)
            if not path.is_last:
                loop.released(t, path.consume(loop.table))
            step = loop.schedule(t, path)
            if path.is_last:
                path.publish(step.view, outputs(step))
            else:
                path.post(step.view)
            t += 1
        elapsed = time.monotonic() - start
        cpu = _thread_cpu_s(path.watcher._thread) - cpu0
        calls = sum(counting.calls.values()) - calls0
        stop.set()
        if observer is not None:
            observer.join()
        path.close(drain=False)
        key = "board" if with_board else "none"
        out[key] = {"steps_per_s": t / elapsed, "watcher_cpu_ms_per_s": 1e3 * cpu / elapsed,
                    "watcher_cpu_us_per_step": 1e6 * cpu / max(t, 1),
                    "store_calls_per_s": calls / elapsed, "calls": dict(counting.calls)}
        if gaps:
            g = np.array(gaps)
            out["gaps"] = {"n": len(g), "median": float(np.median(g)),
                           "p99": float(np.percentile(g, 99)), "max": float(g.max())}
        dist.barrier(group=group)
    return out


def _busy(stop: Any) -> None:
    x = 0
    while not stop.is_set():
        for _ in range(100_000):
            x += 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ppsync.probes.heartbeat_cost",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--pp-size", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--load", type=int, default=2, help="busy processes beside the ranks")
    ap.add_argument("--step-ms", type=float, default=0.0,
                    help="engine time per step (a sleep), 0: as fast as it goes")
    args = ap.parse_args(argv)
    ctx = mp.get_context("fork")
    stop = ctx.Event()
    load = [ctx.Process(target=_busy, args=(stop,), daemon=True) for _ in range(args.load)]
    for p in load:
        p.start()
    try:
        results = spawn_ranks(functools.partial(_rank, args.pp_size, args.seconds,
                                                 args.step_ms), args.pp_size,
                              timeout_s=4 * args.seconds + 120)
    finally:
        stop.set()
        for p in load:
            p.join(5)
    print(f"heartbeats: P = {args.pp_size}, {args.seconds:g} s per run, {args.load} busy "
          f"processes beside, engine step {args.step_ms:g} ms + the token path")
    print(f"{'rank':>4} {'board':>6} {'steps/s':>9} {'store calls/s':>14} "
          f"{'watcher ms/s':>13} {'watcher µs/step':>16}")
    for rank, r in enumerate(results):
        for key in ("board", "none"):
            f = r[key]
            print(f"{rank:>4} {key:>6} {f['steps_per_s']:>9.0f} {f['store_calls_per_s']:>14.2f} "
                  f"{f['watcher_cpu_ms_per_s']:>13.2f} {f['watcher_cpu_us_per_step']:>16.2f}")
    gaps = results[0].get("gaps")
    if gaps:
        print(f"beat intervals seen by rank 0's reader (every {WATCH_EVERY_S * 1e3:.0f} ms): "
              f"n {gaps['n']}, median {gaps['median']:.3f} s, p99 {gaps['p99']:.3f} s, "
              f"max {gaps['max']:.3f} s")
    print(f"store calls of rank 0's board by kind: {results[0]['board']['calls']}")
    return 0


if __name__ == "__main__":
    from ppsync.probes import heartbeat_cost

    sys.exit(heartbeat_cost.main())
