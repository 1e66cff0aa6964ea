"""Rule 3 of docs/design.md: GenerationTable."""

from __future__ import annotations

import numpy as np
import pytest

from ppsync.core.path.generations import GenerationTable
from ppsync.errors import BatchError


def _generations(table: GenerationTable) -> list[int]:
    return [table.generation(s) for s in range(table.max_num_reqs)]


def test_fresh_table_is_all_zero() -> None:
    assert _generations(GenerationTable(4)) == [0, 0, 0, 0]


def test_bump_increments_only_that_slot() -> None:
    table = GenerationTable(4)
    table.bump(2)
    table.bump(2)
    table.bump(0)
    assert _generations(table) == [1, 0, 2, 0]


def test_unchanged_since_flags_rows_whose_slot_was_freed() -> None:
    table = GenerationTable(6)
    idx = np.array([5, 2, 0, 3], dtype=np.int64)
    mark = table.mark()
    assert table.unchanged_since(idx, mark) is None
    table.bump(2)
    table.bump(4)  # not in the batch: no row affected
    unchanged = table.unchanged_since(idx, mark)
    assert unchanged is not None and unchanged.dtype == np.bool_
    assert unchanged.tolist() == [True, False, True, True]


def test_a_second_free_of_the_same_slot_still_counts_as_changed() -> None:
    table = GenerationTable(2)
    idx = np.array([1])
    table.bump(1)
    mark = table.mark()
    table.bump(1)
    since = table.unchanged_since(idx, mark)
    assert since is not None and since.tolist() == [False]
    assert table.unchanged_since(idx, table.mark()) is None


def test_empty_batch() -> None:
    table = GenerationTable(3)
    idx = np.array([], dtype=np.int64)
    mark = table.mark()
    table.bump(1)
    since = table.unchanged_since(idx, mark)
    assert since is not None and since.shape == (0,)


def test_numpy_integer_slot_is_accepted() -> None:
    table = GenerationTable(3)
    table.bump(np.int64(1))  # type: ignore[arg-type]
    table.bump(np.int32(1))  # type: ignore[arg-type]
    assert table.generation(1) == 2


@pytest.mark.parametrize("req_idx", [-1, 4, 100])
def test_out_of_range_slot_names_the_value(req_idx: int) -> None:
    table = GenerationTable(4)
    with pytest.raises(
        BatchError, match=rf"req_idx = {req_idx} outside \[0, max_num_reqs = 4\)"
    ):
        table.bump(req_idx)
    assert _generations(table) == [0, 0, 0, 0]
    assert table.mark() == 0


@pytest.mark.parametrize(
    ("req_idx", "shown"), [(1.0, "1.0"), ("1", "'1'"), (True, "True"), (None, "None")]
)
def test_non_int_slot_names_the_value(req_idx: object, shown: str) -> None:
    table = GenerationTable(4)
    with pytest.raises(BatchError, match=rf"req_idx = {shown} must be an int"):
        table.bump(req_idx)  # type: ignore[arg-type]
    assert _generations(table) == [0, 0, 0, 0]


def test_marks_tell_frees_apart() -> None:
    table = GenerationTable(6)
    idx = np.array([5, 0, 3, 1], dtype=np.int64)
    mark = table.mark()
    table.bump(3)
    table.bump(2)  # a slot no row holds
    since = table.unchanged_since(idx, mark)
    assert since is not None and since.tolist() == [True, True, False, True]
    later = table.mark()
    assert table.unchanged_since(idx, later) is None
    table.bump(5)
    since = table.unchanged_since(idx, later)
    assert since is not None and since.tolist() == [False, True, True, True]
