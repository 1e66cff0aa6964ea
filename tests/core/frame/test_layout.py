"""ppsync.core.frame.layout: the one definition of the frame's words."""

from __future__ import annotations

from ppsync.core.frame import (
    FLAG_BAD_VALUES,
    FLAG_EXACT,
    FLAG_HAS_DRAFTS,
    HEADER_WORDS,
    FrameLayout,
    Header,
    Staging,
)
from ppsync.core.frame.layout import HEADER_NAMES
from ppsync.schemas.config import SyncConfig


def test_flags_are_distinct_bits() -> None:
    flags = (FLAG_HAS_DRAFTS, FLAG_EXACT, FLAG_BAD_VALUES)
    assert all(f > 0 and f & (f - 1) == 0 for f in flags)
    assert sum(flags) == FLAG_HAS_DRAFTS | FLAG_EXACT | FLAG_BAD_VALUES


def test_header_words_are_named_in_order() -> None:
    assert HEADER_WORDS == len(HEADER_NAMES) == 8
    assert [int(h) for h in Header] == list(range(HEADER_WORDS))
    assert HEADER_NAMES[Header.SAMPLE_WIDTH] == "sample_width"
    assert HEADER_NAMES[Header.CHECKSUM] == "checksum"


def test_columns_and_staging_regions_do_not_overlap() -> None:
    lay = FrameLayout(SyncConfig.build(pp_size=2, max_num_reqs=8, num_speculative_steps=3))
    L, K = lay.sample_width, lay.num_drafts
    c = lay.columns
    cols = [c.num_sampled.offset, c.num_rejected.offset, c.drafts.offset, c.slot_need.offset,
            c.num_computed.offset]
    assert cols == [L, L + 1, L + 2, L + 2 + K, L + 3 + K]
    assert lay.row_width == L + 4 + K
    at = Staging(8)
    assert HEADER_WORDS == Staging.bounds < Staging.facts_at == Staging.bounds + 2
    assert Staging.facts(8).stop <= at.idx_out < at.kept_slots < at.kept_rows < at.verdict
    assert at.words == at.verdict + 1 == HEADER_WORDS + 2 + 5 * 8 + 1
