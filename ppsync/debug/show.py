"""``ppsync dump show``: merge one group's dumps into one picture and name
the culprit.

Per rank: the last step and frame seq reached, what it was waiting on
(the oldest transfer in flight at dump time, or the one its error names)
and for how long. Across ranks: who is ahead of whom, the ranks that never
dumped (lost or stopped: they could not), the rank whose last event is the
oldest when every rank dumped, and the first seq whose views differ.

A *view* of a frame is what a rank issued it with: (num_reqs, rows needing
a sample, idx digest, L, K). Every rank derives it from its own batch view,
so on a healthy group all ranks agree at every seq; the first seq where
they do not is where the group split, and the ranks outside the majority
(on a tie: outside the last rank's side) are the culprits.

Verdict rules, first match wins, each from evidence, never from absence:
views differ -> desync at that seq; a survivor's error names the rank it
waited on (PeerLost / SyncTimeout ``peer``, in its footer) -> that rank,
lost or silent as the first of them to give up saw it, whether or not it
dumped (a stalled rank that resumed dumps too, last: silent, since it
outlived their giving up); a rank without a dump while a survivor failed
-> lost or silent; an error with every rank dumped and no rank named ->
the rank that stopped first (oldest last event, its own error event not
counted); otherwise OK. A footer whose error is ``Stopped`` (the process
was ended by a signal: a launcher stopping its ranks) is no error of the
rank's: its state says ``stopped_by`` the signal, and the group's
``stopped_by`` the first such signal (the world's verdict then reads
STOPPED, not OK: the run did not run to its end). A rank without a dump that nobody waited on is
only "not at hand" (each host of a multi-host run keeps its own dump
directory). The summary says how sure the verdict is.

Dumps carry the run id the group agreed on at its handshake, and the id
of the world: ``ppsync.debug.world_show`` picks one world and reads each of its
groups here.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Sequence
from typing import Literal

from pydantic import BaseModel, ConfigDict

from ppsync.debug.load import RankDump

Verdict = Literal["ok", "desync", "lost", "silent", "stopped", "error"]


class RankState(BaseModel):
    """One rank as its dump shows it (or as its absence does)."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    rank: int
    """Global rank."""
    group_rank: int
    """Rank in the group."""
    dumped: bool
    """Whether this rank's dump was given."""
    reason: str | None = None
    """What triggered its dump."""
    error: str | None = None
    """'Type: message' of the error in its footer."""
    last_step: int | None = None
    """post/publish calls made."""
    last_seq: int | None = None
    """Highest frame seq issued (-1: none)."""
    waiting_seq: int | None = None
    """The seq it was waiting on at dump time (oldest in flight, or its error's)."""
    waiting_op: str | None = None
    """'send' or 'recv'."""
    waited_ms: float | None = None
    """How long that transfer had been in flight at dump time."""
    last_event_ms: float | None = None
    """Time of its last event, ms after the group's first event (clocks
    aligned by the dumps' clock pairs)."""
    stopped_by: str | None = None
    """The signal that ended the process (its footer's ``Stopped`` error),
    e.g. 'SIGTERM'; None: not ended by one."""


class Divergence(BaseModel):
    """The first seq whose views differ, with both sides."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    seq: int
    """Frame seq."""
    ranks: list[int]
    """Ranks on the minority side (the culprits)."""
    view: dict[str, int]
    """Their view."""
    others: list[int]
    """Ranks on the majority side."""
    others_view: dict[str, int]
    """The majority's view."""


class GroupReport(BaseModel):
    """One group's report (``ppsync dump show --json`` prints each inside the
    world's, ppsync.debug.world_show)."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    group_ranks: list[int]
    """Global ranks of the group."""
    ranks: list[RankState]
    """Every rank of the group, in group order."""
    missing: list[int]
    """Ranks that never dumped."""
    ahead: list[str]
    """Who is ahead of whom, by frames issued."""
    stopped_first: int | None
    """Among the ranks that dumped, the one whose last event is the oldest."""
    divergence: Divergence | None
    """The first seq whose views differ."""
    verdict: Verdict
    """The kind of fault found."""
    culprit_rank: int | None
    """The rank the verdict blames."""
    culprit_seq: int | None
    """The frame seq the verdict names."""
    evidence: str
    """How sure the verdict is, e.g. 'every survivor waited on rank 1'."""
    summary: str
    """One line, e.g. 'rank 1 lost at seq 1041: ranks 0 and 2 waited on it'."""
    stopped_by: str | None = None
    """The signal that ended a rank of the group (the first rank's); None:
    none was ended by a signal."""


_VIEW_FIELDS = ("num_reqs", "rows_needed", "idx_digest")


def _views(d: RankDump) -> dict[int, dict[str, int]]:
    c = d.header.config
    out = {}
    for e in d.events:
        if e["kind"] == "issue":
            out[e["seq"]] = {**{k: e[k] for k in _VIEW_FIELDS},
                             "sample_width": c.num_speculative_steps + 1,
                             "num_drafts": c.num_speculative_steps}
    return out


def _divergence(dumps: Sequence[RankDump]) -> Divergence | None:
    views = {d.rank: _views(d) for d in dumps}
    last = next((d.rank for d in dumps if d.is_last), None)
    seqs = sorted(set().union(*(v.keys() for v in views.values())))
    for seq in seqs:
        have = {r: v[seq] for r, v in views.items() if seq in v}
        if len(have) < 2:
            continue
        sides: dict[tuple[int, ...], list[int]] = {}
        for r, v in sorted(have.items()):
            sides.setdefault(tuple(v.values()), []).append(r)
        if len(sides) == 1:
            continue
        ordered = sorted(sides.values(), key=lambda rs: (-len(rs), last not in rs, rs))
        major = ordered[0]
        minor = sorted(r for rs in ordered[1:] for r in rs)
        return Divergence(seq=seq, ranks=minor, view=have[minor[0]], others=major,
                          others_view=have[major[0]])
    return None


def _state(d: RankDump, t0_ns: int) -> RankState:
    f = d.footer
    waiting = f.in_flight[0] if f.in_flight else None
    err_seq = next((e["seq"] for e in reversed(d.events) if e["kind"] == "error"), -1)
    wseq = waiting.seq if waiting else (err_seq if err_seq >= 0 else None)
    # its own error event is recorded when it gives up (a stalled rank: when it
    # resumes), so the last event of the work it did is what dates it
    work = [e for e in d.events if e["kind"] != "error"]
    last_ev = d.wall_of(work[-1]["mono_ns"]) if work else None
    stopped = f.error_type == "Stopped"  # ended by a signal: not an error of its own
    signal = re.search(r"SIG[A-Z0-9]+", f.error_message or "") if stopped else None
    return RankState(
        rank=d.rank, group_rank=d.header.group_rank, dumped=True, reason=d.header.reason,
        error=f"{f.error_type}: {f.error_message}" if f.error_type and not stopped else None,
        stopped_by=(signal.group(0) if signal else "a signal") if stopped else None,
        last_step=f.last_step, last_seq=f.next_seq - 1,
        waiting_seq=wseq, waiting_op=waiting.op if waiting else None,
        waited_ms=waiting.age_ns / 1e6 if waiting else None,
        last_event_ms=None if last_ev is None else (last_ev - t0_ns) / 1e6,
    )


def _first_error(d: RankDump) -> tuple[int, str]:
    """(wall ns, error type) of the rank's first error event; (when it
    dumped, its footer's error type) when none was recorded."""
    return next(((d.wall_of(e["mono_ns"]), e["error"] or "") for e in d.events
                 if e["kind"] == "error"), (d.header.clock.wall_ns, d.footer.error_type or ""))


def rank_names(ranks: Sequence[int]) -> str:
    """"rank 1", "ranks 0 and 2", "ranks 0, 1 and 2"."""
    r = [str(x) for x in ranks]
    if len(r) <= 1:
        return f"rank {''.join(r)}" if r else "no rank"
    return "ranks " + ", ".join(r[:-1]) + " and " + r[-1]


def analyse(dumps: Sequence[RankDump]) -> GroupReport:
    """The report for one group's dumps (every dump of the same group)."""
    group = list(dumps[0].header.group_ranks)
    by_rank = {d.rank: d for d in dumps}
    firsts = [d.wall_of(d.events[0]["mono_ns"]) for d in dumps if d.events]
    t0 = min(firsts) if firsts else 0
    states = [_state(by_rank[r], t0) if r in by_rank
              else RankState(rank=r, group_rank=i, dumped=False)
              for i, r in enumerate(group)]
    missing = [s.rank for s in states if not s.dumped]
    live = [s for s in states if s.dumped]
    order = sorted(live, key=lambda s: (-(s.last_seq or -1), s.rank))
    ahead = [f"rank {a.rank} (seq {a.last_seq}) ahead of rank {b.rank} (seq {b.last_seq})"
             for a, b in itertools.pairwise(order) if (a.last_seq or -1) > (b.last_seq or -1)]
    timed = [s for s in live if s.last_event_ms is not None]
    stopped = min(timed, key=lambda s: (s.last_event_ms, s.rank)).rank if len(timed) > 1 else None
    div = _divergence(dumps)
    errors = [s for s in live if s.error]
    waiters = [s for s in live if s.waiting_seq is not None]
    named: dict[int, list[int]] = {}  # rank -> ranks whose error names it as the one waited on
    for d in dumps:
        peer = d.footer.error_peer
        if peer is not None and peer != d.rank and peer in group:
            named.setdefault(peer, []).append(d.rank)
    verdict: Verdict = "ok"
    culprit: int | None = None
    seq: int | None = None
    evidence = "no error in the dumps at hand"
    if div is not None:
        verdict, culprit, seq = "desync", div.ranks[0], div.seq
        evidence = f"the views of seq {div.seq} differ"
        summary = (f"{rank_names(div.ranks)} diverged at seq {div.seq}: view {div.view} vs "
                   f"{div.others_view} of {rank_names(div.others)}")
    elif named:
        culprit = max(sorted(named), key=lambda r: len(named[r]))
        namers = named[culprit]
        # the namer that gave up first saw the fault itself (a later PeerLost
        # may be only that namer leaving); a culprit whose own error came after
        # it was alive when they gave up: stalled, then resumed
        gave_up, kind = min(_first_error(by_rank[r]) for r in namers)
        resumed = culprit in by_rank and _first_error(by_rank[culprit])[0] > gave_up
        verdict = "lost" if kind == "PeerLost" and not resumed else "silent"
        failed = [s.rank for s in errors if s.rank != culprit]
        evidence = (f"every survivor waited on rank {culprit}" if set(namers) >= set(failed)
                    else f"{rank_names(namers)} waited on rank {culprit}; "
                    f"{rank_names([r for r in failed if r not in namers])} named no rank")
        seq = min((s.waiting_seq for s in waiters if s.rank in namers
                   and s.waiting_seq is not None), default=None)
        summary = (f"rank {culprit} {verdict} at seq {seq}: {rank_names(namers)} waited on it")
    elif missing and errors:
        kinds = {s.error.split(":")[0] for s in errors if s.error}
        verdict = "lost" if "PeerLost" in kinds else "silent"
        culprit = missing[0]
        seq = min((s.waiting_seq for s in waiters if s.waiting_seq is not None), default=None)
        if seq is None:
            seq = max((s.last_seq or -1 for s in live), default=-1) + 1
        who = [s.rank for s in errors]
        evidence = (f"no dump from {rank_names(missing)}, and {rank_names(who)} failed waiting; "
                    "no error named the rank")
        summary = (f"{rank_names(missing)} {verdict} at seq {seq}: {rank_names(who)} "
                   f"waited on {'it' if len(missing) == 1 else 'them'}")
    elif errors:
        verdict = "stopped" if stopped is not None else "error"
        first = next(s for s in live if s.rank == stopped) if stopped is not None else errors[0]
        culprit = first.rank
        seq = (first.last_seq or 0) + 1 if first.waiting_seq is None else first.waiting_seq
        others = [s.rank for s in live if s.rank != culprit]
        evidence = ("no error named a rank; the oldest last event (own error events not "
                    f"counted) is rank {culprit}'s" if verdict == "stopped"
                    else "one rank's own error")
        summary = (f"rank {culprit} stopped first at seq {seq}: {rank_names(others)} "
                   f"waited on it" if verdict == "stopped"
                   else f"rank {culprit} failed: {first.error}")
    else:
        top = max((s.last_seq or -1) for s in live) if live else -1
        summary = f"OK: {len(live)} ranks, no error, up to seq {top}"
        if missing:
            evidence = (f"no dump from {rank_names(missing)}: not at hand (nobody waited on "
                        f"{'it' if len(missing) == 1 else 'them'})")
            summary += f"; {evidence}"
    return GroupReport(group_ranks=group, ranks=states, missing=missing, ahead=ahead,
                       stopped_first=stopped, divergence=div, verdict=verdict,
                       culprit_rank=culprit, culprit_seq=seq, evidence=evidence,
                       summary=summary,
                       stopped_by=next((s.stopped_by for s in live if s.stopped_by), None))


def group_dumps(dumps: Sequence[RankDump]) -> list[list[RankDump]]:
    """Dumps split by group (same group_ranks), each in rank order; one dump
    per rank (a rank's newest, by when its token path was opened, then
    written)."""
    newest: dict[int, RankDump] = {}
    for d in dumps:
        have = newest.get(d.rank)
        if have is None or _when(d) > _when(have):
            newest[d.rank] = d
    groups: dict[tuple[int, ...], list[RankDump]] = {}
    for d in sorted(newest.values(), key=lambda d: d.rank):
        groups.setdefault(tuple(d.header.group_ranks), []).append(d)
    return list(groups.values())


def _when(d: RankDump) -> tuple[int, int]:
    return d.header.opened_wall_ns, d.header.clock.wall_ns


def format_report(report: GroupReport) -> str:
    """The text ``ppsync dump show`` prints for one group."""
    lines = [f"group {report.group_ranks}",
             f"{'rank':>4} {'dumped':<7} {'step':>6} {'seq':>6} {'waiting on':<14} "
             f"{'for_ms':>9} {'last_ms':>9}  error"]
    for s in report.ranks:
        if not s.dumped:
            lines.append(f"{s.rank:>4} {'NO':<7} {'-':>6} {'-':>6} {'-':<14} {'-':>9} {'-':>9}")
            continue
        wait = f"{s.waiting_op} {s.waiting_seq}" if s.waiting_op else (
            f"seq {s.waiting_seq}" if s.waiting_seq is not None else "-")
        lines.append(
            f"{s.rank:>4} {s.reason or '':<7} {s.last_step!s:>6} {s.last_seq!s:>6} {wait:<14} "
            f"{'-' if s.waited_ms is None else f'{s.waited_ms:.1f}':>9} "
            f"{'-' if s.last_event_ms is None else f'{s.last_event_ms:.1f}':>9}  "
            f"{(s.error or (f'stopped by {s.stopped_by}' if s.stopped_by else ''))[:160]}")
    lines += [f"ahead: {a}" for a in report.ahead]
    if report.missing:
        lines.append(f"never dumped: {rank_names(report.missing)}")
    if report.verdict == "stopped":  # the rule that decided; else other evidence did
        lines.append(f"oldest last event: rank {report.stopped_first}")
    if report.divergence is not None:
        d = report.divergence
        lines.append(f"first differing seq {d.seq}: {rank_names(d.ranks)} {d.view}")
        lines.append(f"{'':>{len(str(d.seq)) + 21}}{rank_names(d.others)} {d.others_view}")
    lines.append(f"verdict: {report.summary}")
    lines.append(f"evidence: {report.evidence}")
    return "\n".join(lines)
