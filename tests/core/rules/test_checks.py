"""ppsync.core.rules.checks: the checks on a step's sampled outputs."""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ppsync.core.rules.checks import (
    check_draft_table,
    check_draft_target,
    check_sampled,
    check_sampled_meta,
    check_step_drafts,
    check_step_drafts_meta,
)
from ppsync.errors import BatchError


def _sampled(
    tokens: object = None, num_sampled: object = None, num_rejected: object = None, *,
    num_reqs: int = 3, sample_width: int = 4, num_drafts: int = 3,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """check_sampled with valid defaults for whatever is not given."""
    if tokens is None:
        tokens = torch.zeros(num_reqs, sample_width, dtype=torch.int64)
    if num_sampled is None:
        num_sampled = torch.ones(num_reqs, dtype=torch.int32)
    if num_rejected is None:
        num_rejected = torch.zeros(num_reqs, dtype=torch.int32)
    return check_sampled(
        tokens, num_sampled, num_rejected,
        num_reqs=num_reqs, sample_width=sample_width, num_drafts=num_drafts,
    )


def test_valid_outputs_pass_and_come_back_as_host_arrays() -> None:
    tokens = torch.tensor([[1, 2, 3, 4], [5, 6, -1, -1], [7, -1, -1, -1]])
    ns = torch.tensor([4, 2, 1], dtype=torch.int32)
    nr = torch.tensor([0, 2, 3], dtype=torch.int32)
    tokens_np, ns_np, nr_np = _sampled(tokens, ns, nr)
    assert isinstance(tokens_np, np.ndarray)
    np.testing.assert_array_equal(tokens_np, tokens.numpy())
    np.testing.assert_array_equal(ns_np, ns.numpy())
    np.testing.assert_array_equal(nr_np, nr.numpy())


def test_empty_batch_passes() -> None:
    tokens_np, ns_np, nr_np = _sampled(num_reqs=0)
    assert tokens_np.shape == (0, 4)
    assert ns_np.shape == nr_np.shape == (0,)


def test_int64_counts_pass() -> None:
    _sampled(
        torch.zeros(3, 4, dtype=torch.int64),
        torch.ones(3, dtype=torch.int64),
        torch.zeros(3, dtype=torch.int64),
    )


def test_int32_tokens_are_rejected() -> None:
    # vLLM's token ids are int64; accepting int32 let a held step be sent twice
    # when the engine retried its broadcast
    with pytest.raises(
        BatchError, match=r"^sampled_token_ids\.dtype = torch\.int32 must be torch\.int64$"
    ):
        _sampled(torch.zeros(3, 4, dtype=torch.int32))


def test_non_contiguous_view_passes() -> None:
    base = torch.arange(24, dtype=torch.int64).reshape(3, 8)
    tokens_np, _, _ = _sampled(base[:, ::2])
    np.testing.assert_array_equal(tokens_np, base[:, ::2].numpy())


# -- types and dtypes ------------------------------------------------------------


@pytest.mark.parametrize(
    ("position", "name"), [(0, "sampled_token_ids"), (1, "num_sampled"), (2, "num_rejected")]
)
def test_non_tensor_is_rejected(position: int, name: str) -> None:
    args: list[object] = [None, None, None]
    args[position] = np.zeros((3, 4) if position == 0 else 3, dtype=np.int64)
    with pytest.raises(BatchError, match=rf"^{name} must be a torch\.Tensor, got ndarray$"):
        _sampled(*args)


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.int16, torch.uint8, torch.bool], ids=str
)
@pytest.mark.parametrize(
    ("position", "name"), [(0, "sampled_token_ids"), (1, "num_sampled"), (2, "num_rejected")]
)
def test_bad_dtype_is_rejected(position: int, name: str, dtype: torch.dtype) -> None:
    args: list[object] = [None, None, None]
    args[position] = torch.zeros((3, 4) if position == 0 else 3, dtype=dtype)
    allowed = r"torch\.int64" if position == 0 else r"torch\.int64 or torch\.int32"
    with pytest.raises(
        BatchError, match=rf"^{name}\.dtype = {re.escape(str(dtype))} must be {allowed}$"
    ):
        _sampled(*args)


@pytest.mark.parametrize(
    ("position", "name", "shape", "dims", "want"),
    [
        (0, "sampled_token_ids", (12,), 1, 2),
        (0, "sampled_token_ids", (3, 4, 1), 3, 2),
        (1, "num_sampled", (3, 1), 2, 1),
        (1, "num_sampled", (), 0, 1),
        (2, "num_rejected", (1, 3), 2, 1),
    ],
)
def test_wrong_dims_are_rejected(
    position: int, name: str, shape: tuple[int, ...], dims: int, want: int
) -> None:
    args: list[object] = [None, None, None]
    args[position] = torch.zeros(shape, dtype=torch.int64)
    with pytest.raises(
        BatchError,
        match=rf"^{name} has {dims} dims, shape {re.escape(str(shape))}; {want} expected$",
    ):
        _sampled(*args)


# -- shapes --------------------------------------------------------------------


@pytest.mark.parametrize("rows", [2, 4])
def test_token_rows_must_equal_num_reqs(rows: int) -> None:
    with pytest.raises(
        BatchError, match=rf"sampled_token_ids\.shape\[0\] = {rows} must equal num_reqs = 3"
    ):
        _sampled(torch.zeros(rows, 4, dtype=torch.int64))


@pytest.mark.parametrize("w", [0, 5, 9])
def test_token_width_outside_one_to_l(w: int) -> None:
    with pytest.raises(
        BatchError, match=rf"sampled_token_ids\.shape\[1\] = {w} must lie in \[1, L = 4\]"
    ):
        _sampled(torch.zeros(3, w, dtype=torch.int64))


@pytest.mark.parametrize(
    ("position", "name"), [(1, "num_sampled"), (2, "num_rejected")]
)
@pytest.mark.parametrize("rows", [2, 4])
def test_count_rows_must_equal_num_reqs(position: int, name: str, rows: int) -> None:
    args: list[object] = [None, None, None]
    args[position] = torch.zeros(rows, dtype=torch.int32)
    with pytest.raises(
        BatchError, match=rf"{name}\.shape = \({rows},\) must be \(num_reqs,\) = \(3,\)"
    ):
        _sampled(*args)


# -- ranges ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("values", "row", "value"), [([1, 3, 1], 1, 3), ([-1, 0, 0], 0, -1), ([0, 2, 9], 2, 9)]
)
def test_num_sampled_outside_zero_to_w(values: list[int], row: int, value: int) -> None:
    tokens = torch.zeros(3, 2, dtype=torch.int64)  # w = 2 < L = 4
    with pytest.raises(
        BatchError,
        match=rf"^num_sampled\[{row}\] = {value} outside \[0, w = 2\] \(the sample width sent\)$",
    ):
        _sampled(tokens, torch.tensor(values, dtype=torch.int32))


def test_num_sampled_may_be_zero_or_w() -> None:
    _, ns_np, _ = _sampled(torch.zeros(3, 2, dtype=torch.int64), torch.tensor([0, 2, 1]))
    assert ns_np.tolist() == [0, 2, 1]


@pytest.mark.parametrize(
    ("values", "row", "value"), [([0, 0, 4], 2, 4), ([0, -2, 0], 1, -2)]
)
def test_num_rejected_outside_zero_to_k(values: list[int], row: int, value: int) -> None:
    with pytest.raises(
        BatchError,
        match=rf"^num_rejected\[{row}\] = {value} outside \[0, K = 3\] \(num_speculative_steps\)$",
    ):
        _sampled(num_rejected=torch.tensor(values, dtype=torch.int32))


def test_num_rejected_must_be_zero_without_speculation() -> None:
    with pytest.raises(BatchError, match=r"num_rejected\[0\] = 1 outside \[0, K = 0\]"):
        _sampled(
            torch.zeros(3, 1, dtype=torch.int64),
            num_rejected=torch.tensor([1, 0, 0], dtype=torch.int32),
            sample_width=1, num_drafts=0,
        )


# -- property: valid inputs pass unchanged ---------------------------------------


@dataclass
class SampledCase:
    num_reqs: int
    sample_width: int
    num_drafts: int
    tokens: torch.Tensor  # [num_reqs, w] int64
    num_sampled: torch.Tensor  # [num_reqs] int32 or int64
    num_rejected: torch.Tensor  # [num_reqs] int32 or int64


@st.composite
def sampled_cases(draw: st.DrawFn) -> SampledCase:
    k = draw(st.integers(0, 6))
    n = draw(st.integers(0, 12))
    w = draw(st.integers(1, k + 1))
    int_dtype = st.sampled_from([torch.int64, torch.int32])
    tokens = draw(st.lists(st.integers(-1, 2**31 - 1), min_size=n * w, max_size=n * w))
    ns = draw(st.lists(st.integers(0, w), min_size=n, max_size=n))
    nr = draw(st.lists(st.integers(0, k), min_size=n, max_size=n))
    return SampledCase(
        num_reqs=n, sample_width=k + 1, num_drafts=k,
        tokens=torch.tensor(tokens, dtype=torch.int64).reshape(n, w),
        num_sampled=torch.tensor(ns, dtype=draw(int_dtype)),
        num_rejected=torch.tensor(nr, dtype=draw(int_dtype)),
    )


@settings(max_examples=60, deadline=None)
@given(sampled_cases())
def test_valid_random_outputs_pass_unchanged(case: SampledCase) -> None:
    before = (case.tokens.clone(), case.num_sampled.clone(), case.num_rejected.clone())
    tokens_np, ns_np, nr_np = check_sampled(
        case.tokens, case.num_sampled, case.num_rejected,
        num_reqs=case.num_reqs, sample_width=case.sample_width, num_drafts=case.num_drafts,
    )
    for out, orig, tensor in zip(
        (tokens_np, ns_np, nr_np), before, (case.tokens, case.num_sampled, case.num_rejected),
        strict=True,
    ):
        assert out.shape == tuple(orig.shape)
        assert out.dtype == orig.numpy().dtype
        np.testing.assert_array_equal(out, orig.numpy())
        assert torch.equal(tensor, orig)  # the inputs were not modified


# -- draft tables ----------------------------------------------------------------


def test_draft_table_passes() -> None:
    table = torch.arange(8 * 2, dtype=torch.int64).reshape(8, 2)
    table_np = check_draft_table(table, max_num_reqs=8, num_drafts=2)
    np.testing.assert_array_equal(table_np, table.numpy())
    check_draft_table(table.to(torch.int32), max_num_reqs=8, num_drafts=2)


def test_draft_table_without_speculation() -> None:
    with pytest.raises(
        BatchError, match=r"draft_tokens given but num_speculative_steps = 0: there are no drafts"
    ):
        check_draft_table(torch.zeros(8, 0, dtype=torch.int64), max_num_reqs=8, num_drafts=0)


@pytest.mark.parametrize("shape", [(8, 3), (7, 2), (2, 8)])
def test_draft_table_wrong_shape(shape: tuple[int, int]) -> None:
    with pytest.raises(
        BatchError,
        match=rf"draft_tokens\.shape = {re.escape(str(shape))} must be \(max_num_reqs, K\) = "
        r"\(8, 2\)",
    ):
        check_draft_table(torch.zeros(shape, dtype=torch.int64), max_num_reqs=8, num_drafts=2)


def test_draft_table_wrong_dtype_dims_and_type_use_the_given_name() -> None:
    with pytest.raises(BatchError, match=r"^drafts\.dtype = torch\.float32 must be"):
        check_draft_table(torch.zeros(8, 2), max_num_reqs=8, num_drafts=2, name="drafts")
    with pytest.raises(BatchError, match=r"^drafts has 1 dims, shape \(16,\); 2 expected$"):
        check_draft_table(
            torch.zeros(16, dtype=torch.int64), max_num_reqs=8, num_drafts=2, name="drafts"
        )
    with pytest.raises(BatchError, match=r"^draft_tokens must be a torch\.Tensor, got list$"):
        check_draft_table([[0, 0]] * 8, max_num_reqs=8, num_drafts=2)


def test_draft_target_passes_and_is_returned_as_is() -> None:
    table = torch.zeros(8, 2, dtype=torch.int32)
    assert check_draft_target(table, max_num_reqs=8, num_drafts=2) is table


def test_draft_target_must_be_a_tensor() -> None:
    with pytest.raises(
        BatchError, match=r"^draft_tokens_to_update must be a torch\.Tensor, got ndarray$"
    ):
        check_draft_target(np.zeros((8, 2), dtype=np.int64), max_num_reqs=8, num_drafts=2)


def test_draft_target_without_speculation() -> None:
    with pytest.raises(
        BatchError,
        match=r"draft_tokens_to_update given but num_speculative_steps = 0: there are no drafts",
    ):
        check_draft_target(torch.zeros(8, 1, dtype=torch.int64), max_num_reqs=8, num_drafts=0)


@pytest.mark.parametrize("shape", [(8, 3), (4, 2), (16,)])
def test_draft_target_wrong_shape(shape: tuple[int, ...]) -> None:
    with pytest.raises(
        BatchError,
        match=rf"draft_tokens_to_update\.shape = {re.escape(str(shape))} must be "
        r"\(max_num_reqs, K\) = \(8, 2\)",
    ):
        check_draft_target(torch.zeros(shape, dtype=torch.int64), max_num_reqs=8, num_drafts=2)


@pytest.mark.parametrize("dtype", [torch.float16, torch.int16, torch.bool], ids=str)
def test_draft_target_wrong_dtype(dtype: torch.dtype) -> None:
    with pytest.raises(
        BatchError,
        match=rf"draft_tokens_to_update\.dtype = {re.escape(str(dtype))} must be int64 or int32",
    ):
        check_draft_target(torch.zeros(8, 2, dtype=dtype), max_num_reqs=8, num_drafts=2)


@pytest.mark.parametrize("field", ["sampled_token_ids", "num_sampled", "num_rejected",
                                   "draft_tokens"])
def test_outputs_without_data_get_the_device_codecs_error_from_the_host_codec(
        field: str) -> None:
    """One bad input, one error: a tensor the host cannot read (a 'meta'
    device tensor) is the BatchError the device codec gives a tensor off its
    device, never torch's NotImplementedError."""
    cpu = torch.device("cpu")
    good = {"sampled_token_ids": torch.zeros(2, 2, dtype=torch.int64),
            "num_sampled": torch.ones(2, dtype=torch.int32),
            "num_rejected": torch.zeros(2, dtype=torch.int32)}
    drafts = torch.zeros(2, 1, dtype=torch.int64)
    if field == "draft_tokens":
        drafts = drafts.to("meta")
    else:
        good[field] = good[field].to("meta")
    with pytest.raises(BatchError) as host:
        check_sampled(*good.values(), num_reqs=2, sample_width=2, num_drafts=1)
        check_step_drafts(drafts, num_reqs=2, num_drafts=1)
    with pytest.raises(BatchError) as device:
        check_sampled_meta(*good.values(), num_reqs=2, sample_width=2, device=cpu)
        check_step_drafts_meta(drafts, num_reqs=2, num_drafts=1, device=cpu)
    assert str(host.value) == str(device.value) == (
        f"{field} is on meta; the token path's device is cpu")
