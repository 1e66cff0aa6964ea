"""FlightRecorder alone: the ring keeps the newest events in order, an off
recorder keeps none, the in-flight table follows issues and completions,
and an error event names the oldest transfer in flight."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
import torch.distributed as dist

from ppsync.core.frame import FrameView
from ppsync.core.recorder.flight import FIELDS, FlightRecorder, clock_pair
from ppsync.core.recorder.registry import dump_file
from ppsync.errors import ConfigError, PeerLost, SyncTimeout
from ppsync.schemas.dump import DUMP_DIR_ENV, DumpEvent


def test_ring_keeps_the_newest_events_oldest_first() -> None:
    rec = FlightRecorder(5, is_last=False, depth=2)
    for i in range(12):
        rec.free(i, req_idx=i % 3, generation=i)
    assert rec.recorded == 12
    rows = rec.events()
    assert rows.shape == (5, len(FIELDS))
    assert rows[:, FIELDS.index("step")].tolist() == [7, 8, 9, 10, 11]
    events = [DumpEvent.model_validate(d) for d in rec.event_dicts(clock_pair())]
    assert [e.index for e in events] == [7, 8, 9, 10, 11]
    assert all(e.kind == "free" and e.generation == e.step for e in events)
    assert [e.mono_ns for e in events] == sorted(e.mono_ns for e in events)


def test_an_off_recorder_keeps_nothing() -> None:
    rec = FlightRecorder(0, is_last=True, depth=3)
    w = dist.Work()
    rec.issue(w, 0, 0, 0, 4, 4, 1, 2, 0)
    rec.complete(w, 1)
    rec.free(1, 0, 1)
    rec.error(1, SyncTimeout("x"))
    assert rec.recorded == 0 and rec.events().shape == (0, len(FIELDS))
    assert list(rec.event_dicts(clock_pair())) == []
    assert rec.in_flight_seqs() == []


def test_in_flight_follows_issue_consume_and_complete() -> None:
    rec = FlightRecorder(64, is_last=False, depth=3)
    works = [dist.Work() for _ in range(4)]
    for s, w in enumerate(works):
        rec.issue(w, s, s, s + 1, 4, 3, 100 + s, 0, 0)
    assert rec.in_flight_seqs() == [0, 1, 2, 3]
    keep = np.array([True, False, True, True])
    rec.consume(FrameView(0, 4, 100), 4, 4, keep, 3, time.monotonic_ns())
    rec.consume(FrameView(1, 4, 101), 5, 5, None, 0, 0)  # every row excluded: still in flight
    assert rec.in_flight_seqs() == [1, 2, 3]
    rec.complete(works[2], 6)
    rec.complete(works[1], 6)
    assert rec.in_flight_seqs() == [3]
    err = PeerLost("gone", peer=2)
    rec.error(7, err)
    rec.error(7, err)  # the same error again: recorded once
    events = [DumpEvent.model_validate(d) for d in rec.event_dicts(clock_pair())]
    kinds = [e.kind for e in events]
    assert kinds == ["issue"] * 4 + ["consume", "consume", "complete", "complete", "error"]
    released, dropped = events[4], events[5]
    assert (released.seq, released.kept, released.excluded, released.rows_needed) == (0, 3, 1, 3)
    assert released.ring_slot == events[0].ring_slot == 0  # D = 3 advances later, same slot
    assert released.idx_digest == 100
    assert (dropped.kept, dropped.excluded, dropped.blocked_ns) == (0, 4, 0)
    assert [e.seq for e in events[6:8]] == [2, 1]
    assert (events[-1].seq, events[-1].error) == (3, "PeerLost")  # the oldest still in flight
    infl = rec.in_flight(time.monotonic_ns())
    assert [(f.seq, f.op, f.completed) for f in infl] == [(3, "recv", False)]
    assert rec.last_error is err


def test_clock_pair_reads_both_clocks_together() -> None:
    pair = clock_pair()
    assert abs(pair.wall_ns - time.time_ns()) < 1e9
    assert abs(pair.mono_ns - time.monotonic_ns()) < 1e9


@pytest.mark.parametrize("capacity", [1, 7])
def test_small_rings_wrap_without_error(capacity: int) -> None:
    rec = FlightRecorder(capacity, is_last=True, depth=1)
    works = [dist.Work() for _ in range(3)]
    for s in range(30):
        rec.issue(works[s % 3], s, s, 0, 2, 2, s, s, 0)
        if s >= 2:
            rec.complete(works[(s - 2) % 3], s)
    assert rec.events().shape[0] == capacity
    assert rec.in_flight_seqs() == [28, 29]


class _Path:
    """The least a dump needs to name its file."""

    global_rank = 5


def test_dump_without_file_or_directory_is_a_config_error(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv(DUMP_DIR_ENV, raising=False)
    with pytest.raises(ConfigError, match=rf"no file given and no dump directory set .*"
                       rf"\${DUMP_DIR_ENV}"):
        dump_file(_Path(), None)  # type: ignore[arg-type]
    monkeypatch.setenv(DUMP_DIR_ENV, str(tmp_path))
    assert dump_file(_Path(), None) == tmp_path / "ppsync-rank5.jsonl"  # type: ignore[arg-type]
    assert dump_file(_Path(), "x.jsonl") == Path("x.jsonl")  # type: ignore[arg-type]
