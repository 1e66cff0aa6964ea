"""The flight-recorder dump: one JSON Lines file per rank.

Line 1 is a :class:`DumpHeader`, then one :class:`DumpEvent` per recorded
event, oldest first, then a :class:`DumpFooter`. Each line carries a
``type`` field naming its model, so a reader can check every line on its own
against the JSON Schemas exported from these models (``schemas/``).

Times: ``mono_ns`` is the rank's CLOCK_MONOTONIC, comparable only within one
host; ``wall_ns`` is wall-clock time since the epoch. The header's
:class:`ClockPair` was read with both clocks together, so a reader can place
the events of several hosts on one time line (``ppsync dump trace``).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, NonNegativeInt, model_validator

from ppsync.schemas.config import SyncConfig

DUMP_FORMAT_VERSION = 3
"""Version 3 added the world a dump belongs to (``world_id``, ``world_size``);
a reader takes versions 1 to this one (older dumps: world not known)."""

DUMP_DIR_ENV = "PPSYNC_DUMP_DIR"
"""Environment variable naming the directory automatic dumps go to."""

EventKind = Literal["post", "publish", "issue", "complete", "consume", "free", "error"]
EVENT_KINDS: tuple[EventKind, ...] = (
    "post", "publish", "issue", "complete", "consume", "free", "error",
)
"""Event kinds in the order of their integer codes in the recorder's ring."""

DumpReason = Literal["error", "signal", "exit", "request"]


class ClockPair(BaseModel):
    """Both clocks, read back to back (the wall clock between two monotonic
    reads, the pair kept from the closest of a few tries)."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    wall_ns: int
    """time.time_ns(): wall-clock ns since the epoch."""
    mono_ns: int
    """time.monotonic_ns() at the same instant."""


class DumpHeader(BaseModel):
    """First line of a dump: who wrote it, with what configuration."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    type: Literal["header"] = "header"
    """Line type."""
    format_version: int = Field(ge=1, le=DUMP_FORMAT_VERSION)
    """Dump format version (DUMP_FORMAT_VERSION when written; a reader
    refuses a version newer than it knows)."""
    ppsync_version: str
    """ppsync's version."""
    torch_version: str
    """torch's version."""
    rank: int = Field(ge=0)
    """Global rank of the writer."""
    group_rank: int = Field(ge=0)
    """Rank of the writer in its PP (token) group."""
    group_ranks: list[NonNegativeInt] = Field(min_length=1, json_schema_extra={"uniqueItems": True})
    """Global ranks of the group, in group-rank order (the last samples):
    distinct, ``pp_size`` of them, ``rank`` at index ``group_rank``."""
    pp_size: int = Field(ge=1)
    """Ranks in the group."""
    config: SyncConfig
    """The token path's configuration."""
    host: str
    """Host name of the writer."""
    pid: int = Field(ge=0)
    """Process id of the writer."""
    run_id: int
    """The run id every rank of the group agreed on at the start-up
    handshake (0 before it finished): dumps of one run share it, and a
    token path built anew (a new handshake) has another. ``ppsync dump
    show`` reads one run's dumps."""
    world_id: int = 0
    """The id every rank of the world agreed on when it joined (``ppsync
    run`` / ``launch``: one key in the run's store), above the groups' run
    ids: a tensor x pipeline world has one PP group per run id, and
    ``ppsync dump show`` reads every group of a world. 0: not known (a token
    path in an engine's own process, or a dump older than version 3)."""
    world_size: int = Field(default=0, ge=0)
    """Ranks in the writer's world (0: not known, before version 3)."""
    opened_wall_ns: int
    """Wall-clock ns when the token path was built: the newest run is the
    one opened last."""
    clock: ClockPair
    """Wall and monotonic clocks read together at dump time."""
    reason: DumpReason
    """What triggered the dump: an error leaving the token path, a signal
    (SIGUSR1), the process exiting, or an explicit request."""
    capacity: int = Field(ge=0)
    """Events the ring holds (SyncConfig.flight_events)."""
    recorded: int = Field(ge=0)
    """Events recorded since the token path opened."""
    dropped: int = Field(ge=0)
    """Oldest events overwritten by newer ones (recorded - events in the dump)."""

    @model_validator(mode="after")
    def _one_group(self) -> DumpHeader:
        """The group facts agree: what a reader merges the dumps of a group by."""
        ranks = self.group_ranks
        if len(set(ranks)) != len(ranks):
            raise ValueError(f"group_ranks = {ranks} lists a rank twice")
        if len(ranks) != self.pp_size:
            raise ValueError(f"group_ranks = {ranks} holds {len(ranks)} ranks, "
                             f"not pp_size = {self.pp_size}")
        if self.group_rank >= len(ranks) or ranks[self.group_rank] != self.rank:
            raise ValueError(f"rank = {self.rank} is not group_ranks[group_rank = "
                             f"{self.group_rank}] of group_ranks = {ranks}")
        if self.world_size and any(r >= self.world_size for r in ranks):
            raise ValueError(f"group_ranks = {ranks} holds a rank outside world_size = "
                             f"{self.world_size}")
        return self


class DumpEvent(BaseModel):
    """One recorded operation. Fields that do not apply to a kind hold -1
    (seq, ring_slot, req_idx, generation) or 0."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    type: Literal["event"] = "event"
    """Line type."""
    index: int = Field(ge=0)
    """Position in the rank's event sequence (0 = first since open)."""
    kind: EventKind
    """post / publish: a step's call (receiver / last rank), with its view;
    issue: its frame's collective was issued; complete: a transfer was seen
    complete outside a consume (send, dropped receive, drain); consume: a
    receive was released (kept / excluded rows); free: a request slot was
    freed; error: a PPSyncError left the token path."""
    step: int = Field(ge=0)
    """post/publish calls made before this event (the step number)."""
    seq: int = Field(ge=-1)
    """Frame sequence number (-1: no frame)."""
    ring_slot: int = Field(ge=-1)
    """Ring slot (receivers' consume count mod D) of the step; -1 on the last rank."""
    num_reqs: int = Field(ge=0)
    """Rows in the step's batch view."""
    rows_needed: int = Field(ge=0)
    """Rows that need a sample (post/publish/issue) or were needed (consume)."""
    kept: int = Field(ge=0)
    """consume: rows handed out."""
    excluded: int = Field(ge=0)
    """consume: rows dropped (needed no sample, or their slot was freed)."""
    req_idx: int = Field(ge=-1)
    """free: the request slot index freed."""
    generation: int = Field(ge=-1)
    """free: the slot's new generation."""
    idx_digest: int
    """issue / consume: this rank's digest of the step's idx_mapping and
    num_computed_tokens (what the frame header must match)."""
    checksum: int
    """issue on the last rank: the frame's payload checksum (receivers check
    it at consume; a mismatch is a DesyncError, recorded as an error); 0
    elsewhere, and with the device codec (computed on the device, which the
    host does not read)."""
    flags: int = Field(ge=0)
    """issue on the last rank: the frame's flags (FLAG_HAS_DRAFTS,
    FLAG_EXACT; with the device codec the host's flags, without the
    FLAG_BAD_VALUES the device may add); 0 elsewhere."""
    mono_ns: int
    """Monotonic clock when the event was recorded."""
    wall_ns: int
    """Wall clock of the same instant (derived from the header's clock pair)."""
    blocked_ns: int = Field(ge=0)
    """consume / complete: time the call waited for the transfer."""
    error: str | None = None
    """error: the exception type's name."""


class InFlight(BaseModel):
    """A transfer issued and not seen complete by the token path."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    seq: int = Field(ge=0)
    """Frame sequence number."""
    op: Literal["send", "recv"]
    """send (last rank) or recv (other ranks)."""
    issued_mono_ns: int
    """Monotonic clock at the issue."""
    age_ns: int = Field(ge=0)
    """Time from the issue to the dump."""
    completed: bool
    """Whether torch reported the work completed at dump time (finished or
    failed, but not yet observed by the token path)."""


class DumpFooter(BaseModel):
    """Last line of a dump: the error, if any, and what was in flight."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    type: Literal["footer"] = "footer"
    """Line type."""
    error_type: str | None
    """Type name of the error that triggered the dump (None: no error)."""
    error_message: str | None
    """Its message."""
    error_peer: int | None = None
    """The global rank the error names as lost or silent (PeerLost /
    SyncTimeout ``.peer``), where known: the rank this one waited on."""
    in_flight: list[InFlight]
    """Receives and sends in flight at dump time, oldest first."""
    last_step: int = Field(ge=0)
    """post/publish calls made so far."""
    next_seq: int = Field(ge=0)
    """The seq the next frame would get."""
    closed: bool
    """Whether the token path was closed."""
