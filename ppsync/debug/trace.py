"""``ppsync dump trace``: a group's dumps as one Chrome trace-event file,
which Perfetto (ui.perfetto.dev) and chrome://tracing open.

One process per rank (pid = global rank). Track 0 ("calls") holds the
engine-facing calls: consume slices (their wait; dur = the time blocked),
and instants for posts/publishes without a transfer, frees and errors.
Tracks 1.. hold the transfers: a slice per frame from its issue to its end
(the consume that released it, the completion seen by the path, or the dump
when still in flight), one track per ring slot on receivers (a slot holds
one frame at a time) and per seq modulo D + 2 on the last rank.

Times are wall-clock microseconds from the group's first event. Each rank's
monotonic readings are turned into wall time with its dump header's clock
pair, so dumps from several hosts share one time line (as far as their
wall clocks agree). Every event of every dump appears in the trace, its
index under ``args.index`` (a transfer slice: its issue event's, and
``args.end_index`` for the event that ended it).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ppsync.debug.load import RankDump


def _us(ns: int) -> float:
    return ns / 1e3


def rank_events(d: RankDump, t0_ns: int) -> list[dict[str, Any]]:
    """Trace events of one rank."""
    pid = d.rank
    role = "last" if d.is_last else "receiver"
    out: list[dict[str, Any]] = [
        {"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "ts": 0,
         "args": {"name": f"rank {d.rank} (group rank {d.header.group_rank}, {role})"}},
        {"ph": "M", "name": "thread_name", "pid": pid, "tid": 0, "ts": 0,
         "args": {"name": "calls"}},
    ]
    depth = d.header.config.depth

    def ts(mono_ns: int) -> float:
        return _us(d.wall_of(mono_ns) - t0_ns)

    def track(e: dict[str, Any]) -> int:
        slot: int = e["ring_slot"] if e["ring_slot"] >= 0 else e["seq"] % (depth + 2)
        return 1 + slot

    open_issues: dict[int, dict[str, Any]] = {}
    tracks: set[int] = set()
    for e in d.events:
        kind, i = e["kind"], e["index"]
        if kind == "issue":
            open_issues[e["seq"]] = e
            continue
        if kind in ("consume", "complete") and e["seq"] in open_issues:
            start = open_issues.pop(e["seq"])
            tid = track(start)
            tracks.add(tid)
            end = e["mono_ns"]
            out.append({"ph": "X", "name": f"frame {start['seq']}", "cat": "transfer",
                        "pid": pid, "tid": tid, "ts": ts(start["mono_ns"]),
                        "dur": max(0.0, _us(end - start["mono_ns"])),
                        "args": {"index": start["index"], "end_index": i,
                                 "num_reqs": start["num_reqs"],
                                 "rows_needed": start["rows_needed"]}})
        if kind == "consume":
            out.append({"ph": "X", "name": f"consume {e['seq']}", "cat": "call", "pid": pid,
                        "tid": 0, "ts": ts(e["mono_ns"] - e["blocked_ns"]),
                        "dur": _us(e["blocked_ns"]),
                        "args": {"index": i, "kept": e["kept"], "excluded": e["excluded"]}})
        elif kind == "complete":
            out.append({"ph": "i", "s": "t", "name": f"complete {e['seq']}", "cat": "transfer",
                        "pid": pid, "tid": 0, "ts": ts(e["mono_ns"]), "args": {"index": i}})
        elif kind == "error":
            out.append({"ph": "i", "s": "p", "name": f"error {e['error']}", "cat": "error",
                        "pid": pid, "tid": 0, "ts": ts(e["mono_ns"]),
                        "args": {"index": i, "seq": e["seq"]}})
        else:  # post / publish without a transfer, free
            extra = ({"req_idx": e["req_idx"], "generation": e["generation"]}
                     if kind == "free" else {"num_reqs": e["num_reqs"]})
            out.append({"ph": "i", "s": "t", "name": kind, "cat": "call", "pid": pid,
                        "tid": 0, "ts": ts(e["mono_ns"]), "args": {"index": i, **extra}})
    dumped = d.header.clock.mono_ns
    for start in open_issues.values():  # still in flight at the dump
        tid = track(start)
        tracks.add(tid)
        out.append({"ph": "X", "name": f"frame {start['seq']} (in flight)", "cat": "transfer",
                    "pid": pid, "tid": tid, "ts": ts(start["mono_ns"]),
                    "dur": max(0.0, _us(dumped - start["mono_ns"])),
                    "args": {"index": start["index"], "end_index": None}})
    if d.footer.error_type:
        out.append({"ph": "i", "s": "p", "name": f"dump: {d.footer.error_type}",
                    "cat": "error", "pid": pid, "tid": 0, "ts": ts(dumped),
                    "args": {"message": d.footer.error_message}})
    for tid in sorted(tracks):
        out.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "ts": 0,
                    "args": {"name": f"transfers {tid - 1}"}})
    return out


def trace(dumps: Sequence[RankDump]) -> dict[str, Any]:
    """The Chrome trace-event document of ``dumps``."""
    firsts = [d.wall_of(d.events[0]["mono_ns"]) for d in dumps if d.events]
    t0 = min(firsts) if firsts else 0
    events: list[dict[str, Any]] = []
    for d in sorted(dumps, key=lambda d: d.rank):
        events += rank_events(d, t0)
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"source": "ppsync dump trace", "t0_wall_ns": t0}}
