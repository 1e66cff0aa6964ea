"""Rule 1 of docs/design.md: need_sampled_mask."""

from __future__ import annotations

import numpy as np
import pytest

from ppsync.core.rules import BatchView
from ppsync.core.rules.mask import need_sampled_mask


def _view(
    computed: list[int],
    scheduled: list[int],
    prefill: list[int],
    max_seq_len: list[int] | None = None,
    is_prefilling: list[bool] | None = None,
) -> BatchView:
    n = len(computed)
    return BatchView(
        num_reqs=n,
        idx_mapping_np=np.arange(n, dtype=np.int32),
        num_computed_tokens_np=np.array(computed, dtype=np.int32),
        num_scheduled_tokens_np=np.array(scheduled, dtype=np.int32),
        prefill_len_np=np.array(prefill, dtype=np.int32),
        max_seq_len_np=None if max_seq_len is None else np.array(max_seq_len, dtype=np.int32),
        is_prefilling_np=None if is_prefilling is None else np.array(is_prefilling, dtype=bool),
    )


def _mask(view: BatchView) -> list[bool]:
    need = need_sampled_mask(view)
    assert need.dtype == np.bool_
    assert need.shape == (view.num_reqs,)
    return [bool(x) for x in need]


def test_final_prefill_chunk_samples_and_non_final_does_not() -> None:
    # prompt of 10 tokens in chunks of 4: 0..4, 4..8 (non-final), 8..10 (final)
    view = _view(computed=[0, 4, 8], scheduled=[4, 4, 2], prefill=[10, 10, 10])
    assert _mask(view) == [False, False, True]


def test_chunk_ending_exactly_at_prefill_len_samples() -> None:
    assert _mask(_view(computed=[0], scheduled=[10], prefill=[10])) == [True]
    assert _mask(_view(computed=[0], scheduled=[9], prefill=[10])) == [False]


def test_decode_rows_sample() -> None:
    view = _view(computed=[10, 11, 50], scheduled=[1, 3, 1], prefill=[10, 10, 7])
    assert _mask(view) == [True, True, True]


def test_mixed_batch() -> None:
    view = _view(
        computed=[0, 10, 3, 20], scheduled=[5, 1, 7, 1], prefill=[10, 10, 10, 5]
    )
    assert _mask(view) == [False, True, True, True]


def test_empty_batch() -> None:
    assert _mask(_view(computed=[], scheduled=[], prefill=[])) == []
    assert _mask(_view(computed=[], scheduled=[], prefill=[], max_seq_len=[])) == []
    empty = _view(computed=[], scheduled=[], prefill=[], max_seq_len=[], is_prefilling=[])
    assert _mask(empty) == []


@pytest.mark.parametrize("with_flag", [False, True], ids=["derived", "is_prefilling_np"])
def test_cap_excludes_prefill_row_whose_one_token_reaches_it(with_flag: bool) -> None:
    # row 0: prompt of 7 with cap 8 -> its one sampled token reaches the cap
    # row 1: prompt of 7 with cap 9 -> a later step still needs the sample
    # row 2: prompt of 8 with cap 8 -> past the cap as well
    view = _view(
        computed=[0, 0, 4], scheduled=[7, 7, 4], prefill=[7, 7, 8], max_seq_len=[8, 9, 8],
        is_prefilling=[True, True, True] if with_flag else None,
    )
    assert _mask(view) == [False, True, False]


@pytest.mark.parametrize("with_flag", [False, True], ids=["derived", "is_prefilling_np"])
def test_cap_never_drops_a_decode_row(with_flag: bool) -> None:
    # prefill_len + 1 >= max_seq_len for every row, and the computed counts sit at
    # or past the cap: decode rows must still sample (rule 1)
    view = _view(
        computed=[7, 8, 20], scheduled=[1, 1, 3], prefill=[7, 7, 7], max_seq_len=[8, 8, 8],
        is_prefilling=[False, False, False] if with_flag else None,
    )
    assert _mask(view) == [True, True, True]


def test_without_cap_prefill_row_at_cap_still_samples() -> None:
    view = _view(computed=[0], scheduled=[7], prefill=[7])
    assert _mask(view) == [True]


def test_cap_does_not_resurrect_a_non_final_chunk() -> None:
    view = _view(computed=[0], scheduled=[3], prefill=[7], max_seq_len=[100])
    assert _mask(view) == [False]


def test_is_prefilling_np_overrides_the_derived_phase() -> None:
    # numbers alone say "prefill" (computed < prefill_len), the flag says decode
    # (e.g. a resumed request whose prompt includes generated tokens)
    assert _mask(_view([5], [1], [6], max_seq_len=[7])) == [False]
    assert _mask(_view([5], [1], [6], max_seq_len=[7], is_prefilling=[False])) == [True]
    # and the other way: numbers say decode, the flag says prefill
    assert _mask(_view([6], [1], [6], max_seq_len=[7])) == [True]
    assert _mask(_view([6], [1], [6], max_seq_len=[7], is_prefilling=[True])) == [False]


def test_is_prefilling_np_is_ignored_without_a_cap() -> None:
    view = _view(computed=[0, 10], scheduled=[7, 1], prefill=[7, 10], is_prefilling=[True, False])
    assert _mask(view) == [True, True]


def test_mask_does_not_modify_the_view() -> None:
    view = _view(computed=[0, 7], scheduled=[7, 1], prefill=[7, 7], max_seq_len=[8, 8])
    before = [a.copy() for a in (view.num_computed_tokens_np, view.num_scheduled_tokens_np,
                                 view.prefill_len_np)]
    _mask(view)
    after = (view.num_computed_tokens_np, view.num_scheduled_tokens_np, view.prefill_len_np)
    for b, a in zip(before, after, strict=True):
        np.testing.assert_array_equal(a, b)


def test_mask_matches_rule_on_random_batches() -> None:
    rng = np.random.default_rng(1234)
    for _ in range(50):
        n = int(rng.integers(0, 20))
        prefill = rng.integers(1, 30, n)
        computed = rng.integers(0, 40, n)
        scheduled = rng.integers(1, 8, n)
        cap = rng.integers(2, 40, n)
        view = _view(computed.tolist(), scheduled.tolist(), prefill.tolist(), cap.tolist())
        expected = [
            bool(c + s >= p and not (c < p and p + 1 >= m))
            for c, s, p, m in zip(computed, scheduled, prefill, cap, strict=True)
        ]
        assert _mask(view) == expected


def test_narrow_dtypes_do_not_wrap() -> None:
    # int8: 100 + 100 would wrap to -56 and wrongly drop the row
    view = BatchView(1, np.array([0]), np.array([100], np.int8), np.array([100], np.int8),
                     np.array([120], np.int8))
    assert need_sampled_mask(view).tolist() == [True]
