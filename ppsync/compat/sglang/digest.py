"""What one SGLang PP message is about, as one stage sees it, and where two
stages' views of it differ.

SGLang's PP loop (``event_loop_pp``) passes two kinds of tensor dict from
stage to stage: ``"proxy"`` (the hidden states of the batch a stage just
ran, for the next stage to run the same batch) and ``"output"`` (the
sampled tokens of a batch, sent by the last stage to the first and relayed
stage by stage, so that every stage applies the same results to the same
batch). Every stage builds each batch from its own copy of the scheduler's
state; nothing in SGLang checks that the batch a message is applied to is
the batch it was made for.

A :class:`StepView` is that batch as one stage sees it, in integers: the
message kind, the message's number on its channel (``step``: the n-th
message of that kind from the previous stage), the number of requests,
a digest of their ids in order, a digest of their request-pool slots in
order, the forward mode, and the token counts. The sender puts its view in
the message; the receiver builds its own from the batch it will apply the
message to and compares (:func:`check_views`): the first field that
differs is named in a :class:`ppsync.errors.DesyncError`.

Pure Python, no SGLang import: :func:`view_of` reads a batch by attribute
names (``reqs``, each with ``rid``, ``origin_input_ids``, ``output_ids``
and its request-pool slot, ``kv.req_pool_idx`` in SGLang 0.5.23, else
``req_pool_idx``; ``forward_mode``), so the unit tests build batches of
their own. Only what a stage fixes when it builds the batch is read: fields
SGLang fills while it runs the forward (``seq_lens_sum``,
``extend_num_tokens`` on a decode step) differ between a stage that has
run the batch (the sender) and one that has not yet (the receiver).
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Protocol

from ppsync.errors import DesyncError

__all__ = ["FIELDS", "KINDS", "Batch", "Req", "StepView", "check_views", "first_difference",
           "slot_of", "view_of"]

KINDS = ("proxy", "output")
"""The message kinds the guard checks, by their code in :attr:`StepView.kind`."""


class Req(Protocol):
    """What the digest reads of one SGLang request (and its slot, see
    :func:`slot_of`)."""

    @property
    def rid(self) -> str: ...
    @property
    def origin_input_ids(self) -> Sequence[int]: ...
    @property
    def output_ids(self) -> Sequence[int]: ...


class Batch(Protocol):
    """What the digest reads of one SGLang ``ScheduleBatch``."""

    @property
    def reqs(self) -> Sequence[Req]: ...


@dataclass(frozen=True, slots=True)
class StepView:
    """One PP message's batch, as one stage sees it (every field an int)."""

    kind: int
    """Index in :data:`KINDS`."""
    step: int
    """The message's number on its channel (0 first), counted per kind."""
    num_reqs: int
    rids: int
    """crc32 of the request ids in batch order."""
    slots: int
    """crc32 of the requests' request-pool slots in batch order."""
    mode: int
    """The batch's forward mode (SGLang's ForwardMode value; -1: none)."""
    tokens: int
    """Tokens the requests hold (prompt and output), summed."""
    token_counts: int
    """crc32 of each request's token count, in batch order."""

    def as_tuple(self) -> tuple[int, ...]:
        """The view as it travels: a tuple of ints in the message's metadata."""
        return (self.kind, self.step, self.num_reqs, self.rids, self.slots, self.mode,
                self.tokens, self.token_counts)

    @classmethod
    def from_tuple(cls, values: object) -> StepView:
        """The view a message carried; DesyncError if it is not one (a peer
        that does not run the same ppsync, or a message not made by it)."""
        if (not isinstance(values, tuple) or len(values) != len(FIELDS)
                or not all(type(v) is int for v in values)):
            raise DesyncError(
                f"the message's ppsync view = {values!r} is not a tuple of {len(FIELDS)} ints "
                f"({', '.join(FIELDS)}): the sending stage runs another ppsync, or none",
                expected={}, received={})
        return cls(*values)

    def describe(self) -> str:
        kind = KINDS[self.kind] if 0 <= self.kind < len(KINDS) else str(self.kind)
        return f"{kind} message {self.step}"


FIELDS: tuple[str, ...] = tuple(f.name for f in fields(StepView))
"""The view's fields in the order they are compared and carried."""


def slot_of(req: Req) -> int | None:
    """The request's request-pool slot (None: none yet)."""
    holder = getattr(req, "kv", req)
    slot: int | None = getattr(holder, "req_pool_idx", None)
    return slot


def _int_or(value: object, default: int) -> int:
    try:
        return int(value)  # type: ignore[call-overload, no-any-return]
    except (TypeError, ValueError):
        return default


def view_of(batch: Batch | None, kind: str, step: int) -> StepView:
    """``batch`` (None: no batch) as the digest sees it, for message
    ``step`` of ``kind``."""
    reqs: Sequence[Req] = () if batch is None else batch.reqs
    mode = getattr(batch, "forward_mode", None)
    rids: list[str] = []
    slots: list[int | None] = []
    counts: list[int] = []
    for r in reqs:  # one pass: this runs twice per message
        rids.append(r.rid)
        slots.append(slot_of(r))
        counts.append(len(r.origin_input_ids) + len(r.output_ids))
    return StepView(
        kind=KINDS.index(kind), step=step, num_reqs=len(reqs),
        rids=zlib.crc32("\x1f".join(rids).encode()), slots=zlib.crc32(str(slots).encode()),
        mode=_int_or(getattr(mode, "value", mode), -1),
        tokens=sum(counts), token_counts=zlib.crc32(str(counts).encode()),
    )


def first_difference(expected: StepView, received: StepView) -> str | None:
    """The first field (in :data:`FIELDS` order) where the two views differ;
    None when they agree."""
    for name, mine, theirs in zip(FIELDS, expected.as_tuple(), received.as_tuple(),
                                  strict=True):
        if mine != theirs:
            return name
    return None


def check_views(expected: StepView, received: StepView, *, stage: int, sender: int) -> None:
    """DesyncError naming ``stage`` (this one), the message, and the first
    differing field with both values, unless the views agree. ``expected``
    is this stage's view, ``received`` what stage ``sender`` put in it."""
    field = first_difference(expected, received)
    if field is None:
        return
    mine, theirs = getattr(expected, field), getattr(received, field)
    raise DesyncError(
        f"SGLang PP stage {stage}: {expected.describe()} from stage {sender}: first differing "
        f"field {field}: this stage's view {field} = {mine}, stage {sender}'s = {theirs} "
        f"(the stages built different batches for the same step)",
        expected=dict(zip(FIELDS, expected.as_tuple(), strict=True)),
        received=dict(zip(FIELDS, received.as_tuple(), strict=True)))
