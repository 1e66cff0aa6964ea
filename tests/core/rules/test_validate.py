"""ppsync.core.rules: validate_batch and batch_view_of."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
import torch

from ppsync.core.rules import BatchView, batch_view_of, out_of_range, validate_batch
from ppsync.errors import BatchError

MAX_NUM_REQS = 8


def _view(n: int = 3, /, **fields: Any) -> BatchView:
    view = BatchView(
        num_reqs=n,
        idx_mapping_np=np.arange(n, dtype=np.int32)[::-1].copy(),
        num_computed_tokens_np=np.zeros(n, dtype=np.int32),
        num_scheduled_tokens_np=np.ones(n, dtype=np.int32),
        prefill_len_np=np.ones(n, dtype=np.int32),
    )
    return dataclasses.replace(view, **fields)


def re_tuple(shape: tuple[int, ...]) -> str:
    return re.escape(str(shape))


def test_valid_batch_passes() -> None:
    validate_batch(_view(), MAX_NUM_REQS)
    validate_batch(
        _view(max_seq_len_np=np.full(3, 100), is_prefilling_np=np.zeros(3, dtype=bool)),
        MAX_NUM_REQS,
    )


def test_full_and_empty_batches_pass() -> None:
    validate_batch(_view(MAX_NUM_REQS), MAX_NUM_REQS)
    validate_batch(_view(0), MAX_NUM_REQS)


@pytest.mark.parametrize("dtype", [np.int8, np.int16, np.int32, np.int64, np.uint32, np.uint64])
def test_every_integer_dtype_passes(dtype: type[np.integer]) -> None:
    arr = np.array([2, 0, 1], dtype=dtype)
    validate_batch(
        _view(idx_mapping_np=arr, num_computed_tokens_np=arr, num_scheduled_tokens_np=arr,
              prefill_len_np=arr, max_seq_len_np=arr),
        MAX_NUM_REQS,
    )


def test_numpy_integer_num_reqs_passes() -> None:
    validate_batch(_view(num_reqs=np.int64(3)), MAX_NUM_REQS)


@pytest.mark.parametrize("n", [-1, MAX_NUM_REQS + 1])
def test_num_reqs_outside_range(n: int) -> None:
    view = _view(0, num_reqs=n)
    with pytest.raises(
        BatchError, match=rf"num_reqs = {n} must lie in \[0, max_num_reqs = {MAX_NUM_REQS}\]"
    ):
        validate_batch(view, MAX_NUM_REQS)


@pytest.mark.parametrize(("n", "shown"), [(True, "True"), (3.0, "3.0"), ("3", "'3'")])
def test_num_reqs_not_an_int(n: object, shown: str) -> None:
    with pytest.raises(BatchError, match=rf"num_reqs = {shown} must be an int"):
        validate_batch(_view(num_reqs=n), MAX_NUM_REQS)


_INT_FIELDS = [
    ("idx_mapping_np", "idx_mapping_np"),
    ("num_computed_tokens_np", "num_computed_tokens_np"),
    ("num_scheduled_tokens_np", "num_scheduled_tokens"),
    ("prefill_len_np", "prefill_len_np"),
    ("max_seq_len_np", "max_seq_len_np"),
]


@pytest.mark.parametrize(("attr", "name"), _INT_FIELDS)
def test_float_dtype_is_rejected(attr: str, name: str) -> None:
    view = _view(**{attr: np.zeros(3, dtype=np.float32)})
    with pytest.raises(BatchError, match=rf"{name}\.dtype = float32 must be an integer dtype"):
        validate_batch(view, MAX_NUM_REQS)


@pytest.mark.parametrize(("attr", "name"), _INT_FIELDS)
def test_bool_dtype_is_rejected_for_counts(attr: str, name: str) -> None:
    view = _view(**{attr: np.zeros(3, dtype=bool)})
    with pytest.raises(BatchError, match=rf"{name}\.dtype = bool must be an integer dtype"):
        validate_batch(view, MAX_NUM_REQS)


@pytest.mark.parametrize(("attr", "name"), _INT_FIELDS)
@pytest.mark.parametrize("shape", [(2,), (4,), (3, 1)])
def test_wrong_shape_is_rejected(attr: str, name: str, shape: tuple[int, ...]) -> None:
    view = _view(**{attr: np.zeros(shape, dtype=np.int64)})
    with pytest.raises(
        BatchError, match=rf"{name}\.shape = {re_tuple(shape)} must be \(num_reqs,\) = \(3,\)"
    ):
        validate_batch(view, MAX_NUM_REQS)


@pytest.mark.parametrize(("attr", "name"), _INT_FIELDS)
def test_torch_tensor_is_rejected_where_numpy_is_expected(attr: str, name: str) -> None:
    view = _view(**{attr: torch.zeros(3, dtype=torch.int64)})
    with pytest.raises(BatchError, match=rf"{name} must be a numpy array, got Tensor"):
        validate_batch(view, MAX_NUM_REQS)


def test_list_is_rejected_where_numpy_is_expected() -> None:
    with pytest.raises(BatchError, match=r"prefill_len_np must be a numpy array, got list"):
        validate_batch(_view(prefill_len_np=[1, 1, 1]), MAX_NUM_REQS)


@pytest.mark.parametrize("dtype", [np.int32, np.uint8, np.float64])
def test_is_prefilling_must_be_bool(dtype: type[np.generic]) -> None:
    view = _view(is_prefilling_np=np.zeros(3, dtype=dtype))
    with pytest.raises(
        BatchError, match=rf"is_prefilling_np\.dtype = {np.dtype(dtype)} must be bool"
    ):
        validate_batch(view, MAX_NUM_REQS)


def test_is_prefilling_shape_is_checked() -> None:
    view = _view(is_prefilling_np=np.zeros(2, dtype=bool))
    with pytest.raises(BatchError, match=r"is_prefilling_np\.shape = \(2,\)"):
        validate_batch(view, MAX_NUM_REQS)


@pytest.mark.parametrize(
    ("idx", "row", "value"),
    [
        ([0, 1, MAX_NUM_REQS], 2, MAX_NUM_REQS),
        ([0, -1, 2], 1, -1),
        ([100, 1, -5], 0, 100),
        ([2, 1, -5], 2, -5),
    ],
)
def test_idx_mapping_out_of_range_names_row_and_value(idx: list[int], row: int, value: int) -> None:
    view = _view(idx_mapping_np=np.array(idx, dtype=np.int64))
    with pytest.raises(
        BatchError,
        match=rf"idx_mapping\[{row}\] = {value} outside \[0, max_num_reqs = {MAX_NUM_REQS}\)",
    ):
        validate_batch(view, MAX_NUM_REQS)


def test_duplicate_request_slot_is_rejected() -> None:
    view = _view(idx_mapping_np=np.array([3, 1, 3], dtype=np.int64))
    with pytest.raises(BatchError, match=r"idx_mapping holds request slot index \d+ twice"):
        validate_batch(view, MAX_NUM_REQS)


@pytest.mark.parametrize(
    ("attr", "name"),
    [
        ("num_computed_tokens_np", "num_computed_tokens_np"),
        ("num_scheduled_tokens_np", "num_scheduled_tokens"),
        ("prefill_len_np", "prefill_len_np"),
    ],
)
def test_negative_counts_name_row_and_value(attr: str, name: str) -> None:
    view = _view(**{attr: np.array([4, -2, 0], dtype=np.int64)})
    with pytest.raises(BatchError, match=rf"{name}\[1\] = -2 outside \[0, 2\*\*62\)"):
        validate_batch(view, MAX_NUM_REQS)


# -- batch_view_of ---------------------------------------------------------


@dataclass
class FakeInputBatch:
    """The attributes of vLLM's input batch that the PPHandler interface reads."""

    num_reqs: int = 3
    idx_mapping: torch.Tensor = field(
        default_factory=lambda: torch.tensor([5, 0, 2], dtype=torch.int64)
    )  # [num_reqs] int64
    idx_mapping_np: np.ndarray = field(
        default_factory=lambda: np.array([5, 0, 2], dtype=np.int64)
    )  # [num_reqs] int64
    num_computed_tokens_np: np.ndarray = field(
        default_factory=lambda: np.array([0, 9, 4], dtype=np.int32)
    )  # [num_reqs] int32
    num_scheduled_tokens: np.ndarray = field(
        default_factory=lambda: np.array([4, 1, 2], dtype=np.int32)
    )  # [num_reqs] int32
    prefill_len_np: np.ndarray = field(
        default_factory=lambda: np.array([8, 6, 6], dtype=np.int32)
    )  # [num_reqs] int32
    max_seq_len_np: np.ndarray | None = field(
        default_factory=lambda: np.array([64, 64, 7], dtype=np.int32)
    )  # [num_reqs] int32
    is_prefilling_np: np.ndarray | None = field(
        default_factory=lambda: np.array([True, False, True])
    )  # [num_reqs] bool


def test_batch_view_of_reads_every_field_without_copying() -> None:
    batch = FakeInputBatch()
    view = batch_view_of(batch)
    assert view.num_reqs == 3
    assert view.idx_mapping_np is batch.idx_mapping_np
    assert view.num_computed_tokens_np is batch.num_computed_tokens_np
    assert view.num_scheduled_tokens_np is batch.num_scheduled_tokens
    assert view.prefill_len_np is batch.prefill_len_np
    assert view.max_seq_len_np is batch.max_seq_len_np
    assert view.is_prefilling_np is batch.is_prefilling_np
    validate_batch(view, MAX_NUM_REQS)


def test_batch_view_of_optional_fields_default_to_none() -> None:
    view = batch_view_of(FakeInputBatch(max_seq_len_np=None, is_prefilling_np=None))
    assert view.max_seq_len_np is None
    assert view.is_prefilling_np is None


def test_batch_view_of_without_optional_attributes() -> None:
    class Minimal:
        num_reqs = 1
        idx_mapping_np = np.array([0])
        num_computed_tokens_np = np.array([0])
        num_scheduled_tokens = np.array([3])
        prefill_len_np = np.array([3])

    view = batch_view_of(Minimal())
    assert view.max_seq_len_np is None
    assert view.is_prefilling_np is None
    assert view.num_scheduled_tokens_np.tolist() == [3]
    validate_batch(view, MAX_NUM_REQS)


def test_batch_view_of_reads_attributes_served_by_getattr() -> None:
    class Proxy:
        """Forwards attribute reads, as engine wrappers and test doubles do."""

        def __init__(self, inner: object) -> None:
            self._inner = inner

        def __getattr__(self, name: str) -> object:
            return getattr(self._inner, name)

    batch = FakeInputBatch()
    view = batch_view_of(Proxy(batch))
    assert view.num_reqs == 3
    assert view.idx_mapping_np is batch.idx_mapping_np
    assert view.num_scheduled_tokens_np is batch.num_scheduled_tokens


@pytest.mark.parametrize(
    "missing",
    ["num_reqs", "idx_mapping_np", "num_computed_tokens_np", "prefill_len_np",
     "num_scheduled_tokens"],
)
def test_batch_view_of_names_a_missing_attribute(missing: str) -> None:
    fields = {
        f.name: getattr(FakeInputBatch(), f.name) for f in dataclasses.fields(FakeInputBatch)
    }
    del fields[missing]
    partial = type("PartialBatch", (), fields)()
    with pytest.raises(BatchError, match=rf"input_batch of type PartialBatch lacks {missing}$"):
        batch_view_of(partial)


def test_batch_view_of_names_every_missing_attribute() -> None:
    with pytest.raises(
        BatchError,
        match=r"input_batch of type object lacks num_reqs, idx_mapping_np, "
        r"num_computed_tokens_np, prefill_len_np, num_scheduled_tokens",
    ):
        batch_view_of(object())


def test_mixed_and_narrow_count_dtypes_are_checked_exactly() -> None:
    n = 3
    ok = BatchView(n, np.arange(n), np.ones(n, np.uint64), np.ones(n, np.int64),
                   np.ones(n, np.int32))
    validate_batch(ok, 8)  # int64 | uint64 has no common type: checked one by one
    validate_batch(BatchView(n, np.arange(n), *(np.full(n, 200, np.uint8),) * 3), 8)
    bad = BatchView(n, np.arange(n), np.ones(n, np.uint64), np.ones(n, np.int64),
                    np.array([1, -1, 1], np.int32))
    with pytest.raises(BatchError, match=r"prefill_len_np\[1\] = -1 outside"):
        validate_batch(bad, 8)
    narrow = BatchView(n, np.arange(n), np.ones(n, np.int8), np.array([1, -3, 1], np.int8),
                       np.ones(n, np.int8))
    with pytest.raises(BatchError, match=r"num_scheduled_tokens\[1\] = -3 outside"):
        validate_batch(narrow, 8)


_DTYPES = [f"{order}{kind}{width}" for order in "<>" for kind in "iu" for width in (1, 2, 4, 8)]


@pytest.mark.parametrize("dtype", _DTYPES)
@pytest.mark.parametrize("hi", [1, 6, 127, 128, 300, 1 << 31, 1 << 62])
def test_out_of_range_agrees_with_a_plain_comparison(dtype: str, hi: int) -> None:
    """The one-reduction range check (own-width unsigned view, widened only
    when hi needs it) says exactly what ``(a < 0) | (a >= hi)`` says, for
    every integer dtype and byte order, at the edges of each width."""
    dt = np.dtype(dtype)
    info = np.iinfo(dt)
    edges = {0, 1, hi - 1, hi, info.max, info.min, -1, 5, 127, 128, 255, 256}
    for v in sorted(e for e in edges if info.min <= e <= info.max):
        a = np.array([0, v, 0], dtype=dt)
        want = bool(v < 0 or v >= hi)
        assert out_of_range(a, hi) is want, (dtype, hi, v)
    assert out_of_range(np.zeros(0, dtype=dt), hi) is False
