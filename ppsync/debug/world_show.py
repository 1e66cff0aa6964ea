"""``ppsync dump show`` over a world: every PP group of one run, one verdict
per group and one for the world.

A tensor x pipeline world has one PP group per tensor rank, each with a
token path of its own and its own run id (agreed at its handshake). The
dump header's ``world_id`` (agreed by every rank of the world when it
joined) ties the groups of one world together. ``show`` reads one world:
the newest (the one whose token paths were opened last) or the one whose
world id or run id is asked for, and names the others it ignored. Dumps
without a world id (0: a token path in an engine's own process, or a dump
older than format version 3) each stand for the world of their run.

Within a world, each group is read as :func:`ppsync.debug.show.analyse`
reads it (a rank's newest dump, one run per group). The world's verdict:
OK only when every group's is; otherwise FAILED, naming the culprit of the
group that failed (a desync, a lost or silent rank before a rank that only
stopped). With no error at hand but a rank of the world without a dump (a
group's missing rank nobody waited on, or every rank of a group), the
world is INCOMPLETE, never OK: that rank's dump may be on another host (each
host of a multi-host run keeps its own dump directory), or it failed before
its token path opened (a rank lost during its group's handshake). With no
error at hand but a rank ended by a signal (a launcher stopped the run:
SIGTERM, SIGINT), the world is STOPPED, naming the signal: no fault was
found, and the run was not checked to its end.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from pydantic import BaseModel, ConfigDict

from ppsync.debug.load import RankDump
from ppsync.debug.show import GroupReport, analyse, format_report, group_dumps, rank_names

WorldKey = tuple[Literal["world", "run"], int]
"""A world as dumps name it: ("world", world_id), or ("run", run_id) for
dumps that carry no world id."""


class WorldReport(BaseModel):
    """What ``ppsync dump show --json`` prints: the world and its groups."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    world_id: int
    """The world's id (0: not known; then ``run_id`` names the one run read)."""
    run_id: int | None
    """The run read, when the dumps carry no world id."""
    world_size: int
    """Ranks in the world (the dumps' ``world_size``; else the groups' ranks)."""
    groups: list[GroupReport]
    """One report per PP group with a dump, in order of their first rank."""
    not_at_hand: list[int]
    """World ranks in no group with a dump."""
    verdict: Literal["ok", "incomplete", "stopped", "failed"]
    """ok: every rank of the world dumped and every group's verdict is ok;
    incomplete: no error at hand, but a rank of the world has no dump;
    stopped: no error at hand, but a rank was ended by a signal;
    failed: a group's verdict is not ok."""
    culprit_rank: int | None
    """The rank the failed group's verdict blames."""
    summary: str
    """One line, e.g. 'FAILED: rank 3 lost at seq 41: rank 1 waited on it (group
    [1, 3]); group [0, 2]: no error in its dumps'."""


def world_of(d: RankDump) -> WorldKey:
    """The world ``d`` belongs to."""
    return ("world", d.header.world_id) if d.header.world_id else ("run", d.header.run_id)


def _when(d: RankDump) -> tuple[int, int]:
    return d.header.opened_wall_ns, d.header.clock.wall_ns


def describe(key: WorldKey) -> str:
    """'world 0x…' or 'run 0x…'."""
    return f"{key[0]} {key[1]:#x}"


def pick_world(dumps: Sequence[RankDump], wanted: int | None
               ) -> tuple[WorldKey | None, list[RankDump], dict[WorldKey, int]]:
    """(the world, its dumps, {other world: its dump count}): the world whose
    id, or one of whose run ids, is ``wanted``, else the one opened last (a
    directory may hold several runs' dumps: an earlier run's, a token path
    built anew). No world (None) when nothing matches ``wanted``."""
    worlds: dict[WorldKey, list[RankDump]] = {}
    for d in dumps:
        worlds.setdefault(world_of(d), []).append(d)
    chosen: WorldKey | None
    if wanted is None:
        chosen = max(worlds, key=lambda k: max(_when(d) for d in worlds[k]))
    else:
        chosen = next((k for k, ds in worlds.items() if k[1] == wanted
                       or any(d.header.run_id == wanted for d in ds)), None)
    others = {k: len(ds) for k, ds in worlds.items() if k != chosen}
    return chosen, worlds.get(chosen, []) if chosen else [], others


def world_groups(dumps: Sequence[RankDump]) -> list[list[RankDump]]:
    """One world's dumps split by PP group, each group's from one run (the
    newest, where a group's token paths were built anew) and one per rank."""
    by_group: dict[tuple[int, ...], list[RankDump]] = {}
    for d in dumps:
        by_group.setdefault(tuple(d.header.group_ranks), []).append(d)
    out = []
    for ds in by_group.values():
        run = max(ds, key=_when).header.run_id
        out += group_dumps([d for d in ds if d.header.run_id == run])
    return sorted(out, key=lambda g: g[0].header.group_ranks)


_ORDER = {"desync": 0, "lost": 1, "silent": 2, "stopped": 3, "error": 4, "ok": 5}


def analyse_world(dumps: Sequence[RankDump], key: WorldKey) -> WorldReport:
    """The report of one world's dumps (as :func:`pick_world` gives them)."""
    groups = [analyse(g) for g in world_groups(dumps)]
    seen = {r for g in groups for r in g.group_ranks}
    size = max((d.header.world_size for d in dumps), default=0) or max(seen, default=-1) + 1
    absent = [r for r in range(size) if r not in seen]
    failed = sorted((g for g in groups if g.verdict != "ok"),
                    key=lambda g: (_ORDER[g.verdict], g.group_ranks))
    if failed:
        clean = [g for g in groups if g.verdict == "ok"]
        # a clean group's own summary would read OK: in a failed world it is not
        groups = [g.model_copy(update={"summary": _clean_in_failed(g)}) if g.verdict == "ok"
                  else g for g in groups]
        parts = [f"{g.summary} (group {g.group_ranks})" for g in failed]
        parts += [f"group {g.group_ranks}: no error in its dumps" for g in clean]
        summary = "FAILED: " + "; ".join(parts)
    else:
        ranks = sum(len(g.ranks) - len(g.missing) for g in groups)
        unseen = sorted([*absent, *(r for g in groups for r in g.missing)])
        summary = (f"OK: {ranks} ranks in {len(groups)} group{'s' * (len(groups) != 1)}, "
                   "no error")
        if unseen:
            # no error at hand is not a clean world: those ranks may have failed
            # before their token path opened, or dumped on another host
            summary = (f"INCOMPLETE: no error in the dumps at hand ({ranks} ranks in "
                       f"{len(groups)} group{'s' * (len(groups) != 1)}); no dump from "
                       f"{rank_names(unseen)}: not at hand (another host's dump directory), "
                       "or failed before its token path opened")
    signals = sorted({g.stopped_by for g in groups if g.stopped_by})
    if signals and not failed:
        ranks = sum(len(g.ranks) - len(g.missing) for g in groups)
        summary = (f"STOPPED by {', '.join(signals)}: no error in the dumps at hand ({ranks} "
                   f"ranks); the run was ended from outside before its end"
                   + (f"; {summary}" if summary.startswith("INCOMPLETE") else ""))
    if absent and failed:
        summary += f"; no dump from {rank_names(absent)} of the world"
    return WorldReport(
        world_id=key[1] if key[0] == "world" else 0,
        run_id=key[1] if key[0] == "run" else None, world_size=size, groups=groups,
        not_at_hand=absent,
        verdict="failed" if failed else "stopped" if signals else
        "incomplete" if "INCOMPLETE" in summary else "ok",
        culprit_rank=failed[0].culprit_rank if failed else None, summary=summary)


def _clean_in_failed(g: GroupReport) -> str:
    top = max((s.last_seq for s in g.ranks if s.last_seq is not None), default=-1)
    return (f"no error in this group's dumps, up to seq {top}; the world failed "
            "(see the world's verdict)")


def format_world(report: WorldReport) -> str:
    """The text ``ppsync dump show`` prints: each group, then the world."""
    what = (f"world {report.world_id:#x}" if report.world_id
            else f"run {report.run_id or 0:#x} (no world id)")
    groups = "\n\n".join(format_report(g) for g in report.groups)
    return (f"{groups}\n\n{what}: {report.world_size} ranks, {len(report.groups)} "
            f"group{'s' * (len(report.groups) != 1)} with dumps\n"
            f"world verdict: {report.summary}")
