"""Rule 3 of docs/design.md: GenerationTable."""

from __future__ import annotations

import numpy as np
import pytest

from ppsync.core.generations import GenerationTable
from ppsync.errors import BatchError


def test_fresh_table_is_all_zero() -> None:
    table = GenerationTable(4)
    snap = table.snapshot(np.array([3, 0, 2], dtype=np.int64))
    assert snap.dtype == np.int64
    assert snap.tolist() == [0, 0, 0]


def test_bump_increments_only_that_slot() -> None:
    table = GenerationTable(4)
    table.bump(2)
    table.bump(2)
    table.bump(0)
    assert table.snapshot(np.arange(4)).tolist() == [1, 0, 2, 0]


def test_snapshot_follows_row_order() -> None:
    table = GenerationTable(5)
    for slot, times in [(1, 1), (3, 2), (4, 3)]:
        for _ in range(times):
            table.bump(slot)
    idx = np.array([4, 1, 3, 0], dtype=np.int32)
    assert table.snapshot(idx).tolist() == [3, 1, 2, 0]


def test_snapshot_is_a_copy() -> None:
    table = GenerationTable(3)
    idx = np.array([0, 1, 2])
    snap = table.snapshot(idx)
    table.bump(1)
    assert snap.tolist() == [0, 0, 0]
    assert table.snapshot(idx).tolist() == [0, 1, 0]


def test_unchanged_flags_rows_whose_slot_was_freed() -> None:
    table = GenerationTable(6)
    idx = np.array([5, 2, 0, 3], dtype=np.int64)
    snap = table.snapshot(idx)
    assert table.unchanged(idx, snap).tolist() == [True, True, True, True]
    table.bump(2)
    table.bump(4)  # not in the batch: no row affected
    unchanged = table.unchanged(idx, snap)
    assert unchanged.dtype == np.bool_
    assert unchanged.tolist() == [True, False, True, True]


def test_a_second_free_of_the_same_slot_still_counts_as_changed() -> None:
    table = GenerationTable(2)
    idx = np.array([1])
    table.bump(1)
    snap = table.snapshot(idx)
    table.bump(1)
    assert table.unchanged(idx, snap).tolist() == [False]
    assert table.unchanged(idx, table.snapshot(idx)).tolist() == [True]


def test_empty_batch() -> None:
    table = GenerationTable(3)
    idx = np.array([], dtype=np.int64)
    snap = table.snapshot(idx)
    assert snap.shape == (0,)
    assert table.unchanged(idx, snap).shape == (0,)


def test_numpy_integer_slot_is_accepted() -> None:
    table = GenerationTable(3)
    table.bump(np.int64(1))  # type: ignore[arg-type]
    table.bump(np.int32(1))  # type: ignore[arg-type]
    assert table.snapshot(np.array([1])).tolist() == [2]


@pytest.mark.parametrize("req_idx", [-1, 4, 100])
def test_out_of_range_slot_names_the_value(req_idx: int) -> None:
    table = GenerationTable(4)
    with pytest.raises(
        BatchError, match=rf"req_idx = {req_idx} outside \[0, max_num_reqs = 4\)"
    ):
        table.bump(req_idx)
    assert table.snapshot(np.arange(4)).tolist() == [0, 0, 0, 0]


@pytest.mark.parametrize(
    ("req_idx", "shown"), [(1.0, "1.0"), ("1", "'1'"), (True, "True"), (None, "None")]
)
def test_non_int_slot_names_the_value(req_idx: object, shown: str) -> None:
    table = GenerationTable(4)
    with pytest.raises(BatchError, match=rf"req_idx = {shown} must be an int"):
        table.bump(req_idx)  # type: ignore[arg-type]
    assert table.snapshot(np.arange(4)).tolist() == [0, 0, 0, 0]


def test_mark_and_unchanged_since_answer_as_snapshot_and_unchanged() -> None:
    table = GenerationTable(6)
    idx = np.array([5, 0, 3, 1], dtype=np.int64)
    mark, snap = table.mark(), table.snapshot(idx)
    assert table.unchanged_since(idx, mark) is None  # nothing freed: every row unchanged
    table.bump(3)
    table.bump(2)  # a slot no row holds
    since = table.unchanged_since(idx, mark)
    assert since is not None and since.tolist() == table.unchanged(idx, snap).tolist()
    assert since.tolist() == [True, True, False, True]
    later = table.mark()
    assert table.unchanged_since(idx, later) is None
    table.bump(5)
    since = table.unchanged_since(idx, later)
    assert since is not None and since.tolist() == [False, True, True, True]
