"""What one flight-recorder dump costs at a given capacity: a recorder filled
to ``--events`` events, written twice and read back (``ppsync dump show``'s
loader), timed. ``python -m ppsync.probes.dump_cost --events 262144``."""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from ppsync.core.recorder.flight import FlightRecorder
from ppsync.core.recorder.snapshot import write_dump
from ppsync.debug.load import load
from ppsync.schemas.config import SyncConfig


class _Path:
    """What a dump reads from a token path, without a group."""

    rank = steps = seq = global_rank = 0
    run_id = 1
    dump_inline = closed = False
    group_ranks = [0, 1]  # noqa: RUF012 (a fixed stand-in)

    def __init__(self, events: int) -> None:
        self.config = SyncConfig.build(pp_size=2, max_num_reqs=8, flight_events=events)
        self.recorder = FlightRecorder(events, is_last=False, depth=2)
        for i in range(events):
            self.recorder.free(i, i % 8, i)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--events", type=int, default=1 << 18, help="ring capacity, filled")
    events = ap.parse_args().events
    path = _Path(events)
    with tempfile.TemporaryDirectory() as d:
        for _ in range(2):
            t0 = time.perf_counter()
            f = write_dump(path, Path(d) / "ppsync-rank0.jsonl", reason="request")
            print(f"{events} events: written in {time.perf_counter() - t0:.2f} s, "
                  f"{f.stat().st_size / 1e6:.0f} MB")
        t0 = time.perf_counter()
        load(f)
        print(f"read back (validated) in {time.perf_counter() - t0:.2f} s")


if __name__ == "__main__":
    main()
