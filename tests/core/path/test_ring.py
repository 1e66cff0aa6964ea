"""Rule 2 of docs/design.md: SlotRing."""

from __future__ import annotations

import pytest

from ppsync.core.path.ring import SlotRing


@pytest.mark.parametrize("depth", [1, 2, 4])
def test_starts_with_depth_empty_slots(depth: int) -> None:
    ring: SlotRing[str] = SlotRing(depth)
    assert ring.depth == depth
    assert ring.head() is None
    assert list(ring.pending()) == []
    # the first D advances pop the initial empty slots
    assert [ring.advance() for _ in range(depth)] == [None] * depth


@pytest.mark.parametrize("depth", [1, 2, 3, 5])
def test_slot_comes_out_after_depth_advances(depth: int) -> None:
    ring: SlotRing[int] = SlotRing(depth)
    popped: list[int | None] = []
    steps = 3 * depth + 2
    for step in range(steps):
        popped.append(ring.advance())
        ring.fill_tail(step)
    # step t's slot is popped by the advance of step t + D
    assert popped == [None] * depth + list(range(steps - depth))


def test_depth_one_hands_back_the_previous_step() -> None:
    ring: SlotRing[str] = SlotRing(1)
    assert ring.advance() is None
    ring.fill_tail("a")
    assert ring.head() == "a"
    assert list(ring.pending()) == ["a"]
    assert ring.advance() == "a"
    assert ring.head() is None
    assert ring.advance() is None


def test_steps_without_a_receive_leave_holes() -> None:
    ring: SlotRing[str] = SlotRing(3)
    out: list[str | None] = []
    for item in ["a", None, "c", None, None, None]:
        out.append(ring.advance())
        if item is not None:
            ring.fill_tail(item)
    assert out == [None, None, None, "a", None, "c"]


def test_head_is_what_advance_pops() -> None:
    ring: SlotRing[str] = SlotRing(2)
    ring.advance()
    ring.fill_tail("a")
    ring.advance()
    ring.fill_tail("b")
    assert ring.head() == "a"
    assert ring.advance() == "a"
    assert ring.head() == "b"


def test_fill_tail_replaces_the_tail_only() -> None:
    ring: SlotRing[str] = SlotRing(2)
    ring.advance()
    ring.fill_tail("a")
    ring.fill_tail("b")
    assert list(ring.pending()) == ["b"]
    ring.advance()
    assert ring.advance() == "b"


def test_pending_lists_filled_slots_oldest_first() -> None:
    ring: SlotRing[str] = SlotRing(4)
    for item in ["a", None, "b", "c"]:
        ring.advance()
        if item is not None:
            ring.fill_tail(item)
    assert list(ring.pending()) == ["a", "b", "c"]
    ring.advance()
    assert list(ring.pending()) == ["b", "c"]


def test_clear_empties_every_slot_and_keeps_depth() -> None:
    ring: SlotRing[str] = SlotRing(3)
    for item in ["a", "b", "c"]:
        ring.advance()
        ring.fill_tail(item)
    ring.clear()
    assert ring.depth == 3
    assert list(ring.pending()) == []
    assert ring.head() is None
    assert [ring.advance() for _ in range(3)] == [None, None, None]
    # still works as a ring of depth 3 afterwards
    ring.fill_tail("d")
    assert [ring.advance() for _ in range(3)] == [None, None, "d"]


@pytest.mark.parametrize("depth", [0, -1])
def test_depth_below_one_is_rejected(depth: int) -> None:
    with pytest.raises(ValueError, match=rf"depth = {depth} must be >= 1"):
        SlotRing[int](depth)
