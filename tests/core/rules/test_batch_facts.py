"""ppsync.core.rules.batch_facts: the token path's one-pass check and mask.

It must be validate_batch + need_sampled_mask + slot_need_words exactly: the
same facts for every valid view and the same BatchError (field, row, value)
for every bad one, whatever the dtypes."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from ppsync.core.frame import slot_need_words
from ppsync.core.rules import BatchView, validate_batch
from ppsync.core.rules.facts import batch_facts
from ppsync.core.rules.mask import need_sampled_mask
from ppsync.errors import BatchError

M = 16
DTYPES = ("int8", "int16", "int32", "int64", "uint8", "uint32", "uint64")
FIELDS = ("idx_mapping_np", "num_computed_tokens_np", "num_scheduled_tokens_np",
          "prefill_len_np")
EDGES = (-1, -128, 0, 1, M - 1, M, 127, 255, 2**31 - 1, 2**62 - 1, 2**62, 2**63 - 1)


def _random_view(rng: np.random.Generator, optional: bool) -> BatchView:
    n = int(rng.integers(0, M + 1))
    idx = rng.permutation(M)[:n]
    computed = rng.integers(0, 40, n)
    view = BatchView(n, idx, computed, rng.integers(0, 5, n), rng.integers(0, 45, n))
    if optional:
        view = dataclasses.replace(view, max_seq_len_np=rng.integers(0, 50, n))
    return view


def _reference(view: BatchView) -> tuple[str, np.ndarray | None, np.ndarray | None]:
    try:
        validate_batch(view, M)
    except BatchError as e:
        return str(e), None, None
    need = need_sampled_mask(view)
    return "", need, slot_need_words(view.idx_mapping_np, need)


def _same(view: BatchView) -> None:
    error, need, slot_need = _reference(view)
    if error:
        with pytest.raises(BatchError) as got:
            batch_facts(view, M)
        assert str(got.value) == error
        return
    facts = batch_facts(view, M)
    assert need is not None and slot_need is not None
    assert facts.need.dtype == np.bool_ and np.array_equal(facts.need, need)
    assert facts.needed == int(need.sum())
    assert facts.block.dtype == np.int64 and facts.block.shape == (3, view.num_reqs)
    assert np.array_equal(facts.idx, view.idx_mapping_np.astype(np.int64))
    assert np.array_equal(facts.slot_need, slot_need)
    assert np.array_equal(facts.computed, view.num_computed_tokens_np.astype(np.int64))


@pytest.mark.parametrize("optional", [False, True])
def test_random_valid_and_mutated_views_match_the_reference(optional: bool) -> None:
    rng = np.random.default_rng(7)
    for _ in range(400):
        view = _random_view(rng, optional)
        _same(view)
        if view.num_reqs == 0:
            continue
        field = FIELDS[int(rng.integers(len(FIELDS)))]
        dtype = DTYPES[int(rng.integers(len(DTYPES)))]
        a = getattr(view, field).copy()
        a[int(rng.integers(view.num_reqs))] = EDGES[int(rng.integers(len(EDGES)))]
        with np.errstate(over="ignore"):
            _same(dataclasses.replace(view, **{field: a.astype(dtype)}))


@pytest.mark.parametrize("dtype", DTYPES)
def test_edge_values_in_every_dtype_match_the_reference(dtype: str) -> None:
    base = BatchView(3, np.array([2, 0, 1]), np.array([3, 0, 9]), np.array([1, 1, 1]),
                     np.array([4, 2, 20]))
    for field in FIELDS:
        for value in EDGES:
            for row in range(3):
                a = getattr(base, field).copy()
                a[row] = value
                with np.errstate(over="ignore"):
                    a = a.astype(dtype)  # a narrow dtype wraps, as an engine's would
                _same(dataclasses.replace(base, **{field: a}))


def test_a_duplicate_slot_is_refused_as_validate_batch_names_it() -> None:
    view = BatchView(3, np.array([4, 7, 4]), np.zeros(3, np.int64), np.ones(3, np.int64),
                     np.ones(3, np.int64))
    with pytest.raises(BatchError, match="request slot index 4 twice"):
        batch_facts(view, M)


def test_the_facts_are_copies_the_engine_may_refill() -> None:
    view = BatchView(2, np.array([1, 0], np.int32), np.array([5, 6]), np.array([1, 1]),
                     np.array([1, 1]))
    facts = batch_facts(view, M)
    view.idx_mapping_np[:] = 9
    view.num_computed_tokens_np[:] = 0
    assert facts.idx.tolist() == [1, 0] and facts.computed.tolist() == [5, 6]
