"""ppsync.core.frame: NumpyFrames pack/check and the idx_mapping digest."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

from ppsync.core.frame import (
    FLAG_EXACT,
    FLAG_HAS_DRAFTS,
    FRAME_FORMAT_VERSION,
    HEADER_WORDS,
    BufferPool,
    FrameView,
    slot_need_words,
)
from ppsync.core.frame.numpy_frames import NumpyFrames
from ppsync.errors import DesyncError
from ppsync.schemas.config import SyncConfig, WireMode

MAX_NUM_REQS = 6


def _codec(k: int = 0, wire: WireMode = "fixed", max_num_reqs: int = MAX_NUM_REQS) -> NumpyFrames:
    return NumpyFrames(
        SyncConfig.build(
            pp_size=2, max_num_reqs=max_num_reqs, num_speculative_steps=k, wire=wire
        )
    )


@dataclass
class Step:
    view: FrameView
    idx_np: np.ndarray  # [num_reqs] int64
    tokens_np: np.ndarray  # [num_reqs, w] int64
    num_sampled_np: np.ndarray  # [num_reqs] int32
    num_rejected_np: np.ndarray  # [num_reqs] int32
    drafts_np: np.ndarray | None  # [num_reqs, K] int64


def _facts(idx: np.ndarray, need: np.ndarray | None = None,
           computed: np.ndarray | None = None) -> np.ndarray:
    """[2, n] row facts (slot_need, computed) as the token path builds them."""
    need = np.ones(idx.shape[0], dtype=bool) if need is None else need
    computed = np.zeros(idx.shape[0], dtype=np.int64) if computed is None else computed
    return np.stack([slot_need_words(idx, need), computed.astype(np.int64)])


def _step(
    codec: NumpyFrames, *, seq: int = 0, num_reqs: int = 3, w: int | None = None,
    drafts: bool = True, seed: int = 0,
) -> Step:
    rng = np.random.default_rng(seed)
    L, K = codec.sample_width, codec.num_drafts
    w = L if w is None else w
    idx = rng.permutation(codec.max_num_reqs)[:num_reqs].astype(np.int64)
    need = rng.random(num_reqs) < 0.8
    computed = rng.integers(0, 4096, num_reqs, dtype=np.int64)
    return Step(
        view=FrameView(seq, num_reqs, codec.facts_digest(_facts(idx, need, computed)),
                       slot_need_words(idx, need), computed),
        idx_np=idx,
        tokens_np=rng.integers(0, 150_000, (num_reqs, w), dtype=np.int64),
        num_sampled_np=rng.integers(0, w + 1, num_reqs).astype(np.int32),
        num_rejected_np=rng.integers(0, K + 1, num_reqs).astype(np.int32),
        drafts_np=rng.integers(0, 150_000, (num_reqs, K), dtype=np.int64)
        if drafts and K else None,
    )


def _pack(codec: NumpyFrames, step: Step) -> np.ndarray:
    buf_np = BufferPool(codec).take(step.view.num_reqs).numpy()
    buf_np[:] = 0x7777  # stale bytes: pack must overwrite everything it uses
    codec.pack(buf_np, step.view, step.tokens_np, step.num_sampled_np, step.num_rejected_np,
               step.drafts_np)
    return buf_np


# -- sizes -------------------------------------------------------------------


@pytest.mark.parametrize("k", [0, 3])
def test_fixed_wire_is_sized_for_max_num_reqs(k: int) -> None:
    codec = _codec(k)
    assert codec.row_width == (k + 1) + 2 + k + 2  # ... drafts, slot_need, computed
    for n in (0, 1, MAX_NUM_REQS):
        assert codec.words(n) == HEADER_WORDS + MAX_NUM_REQS * codec.row_width
        assert BufferPool(codec).take(n).numel() == codec.words(n)


@pytest.mark.parametrize("k", [0, 3])
def test_exact_wire_is_sized_for_num_reqs(k: int) -> None:
    codec = _codec(k, "exact")
    for n in (0, 1, MAX_NUM_REQS):
        assert codec.words(n) == HEADER_WORDS + n * codec.row_width
        assert BufferPool(codec).take(n).numel() == codec.words(n)


# -- round trip ----------------------------------------------------------------


@pytest.mark.parametrize("wire", ["fixed", "exact"])
@pytest.mark.parametrize("k", [0, 3])
def test_round_trip(k: int, wire: WireMode) -> None:
    codec = _codec(k, wire)
    step = _step(codec, seq=11, num_reqs=4)
    buf_np = _pack(codec, step)

    flags = codec.check(buf_np.copy(), step.view, rank=0)
    expected_flags = (FLAG_EXACT if wire == "exact" else 0) | (FLAG_HAS_DRAFTS if k else 0)
    assert flags == expected_flags

    rows = codec.rows(buf_np, 4)
    L = k + 1
    np.testing.assert_array_equal(rows[:, :L], step.tokens_np)
    np.testing.assert_array_equal(rows[:, L], step.num_sampled_np)
    np.testing.assert_array_equal(rows[:, L + 1], step.num_rejected_np)
    assert step.drafts_np is not None or k == 0
    if step.drafts_np is not None:
        np.testing.assert_array_equal(codec.drafts(rows), step.drafts_np)

    head = codec.header_dict(buf_np)
    assert head["version"] == FRAME_FORMAT_VERSION
    assert head["seq"] == 11
    assert head["num_reqs"] == 4
    assert head["sample_width"] == L
    assert head["num_drafts"] == k
    assert head["flags"] == expected_flags
    assert head["idx_digest"] == step.view.idx_digest


@pytest.mark.parametrize("w", [1, 2, 3])
def test_narrow_tokens_are_padded_with_minus_one(w: int) -> None:
    codec = _codec(3)  # L = 4
    step = _step(codec, num_reqs=3, w=w)
    buf_np = _pack(codec, step)
    codec.check(buf_np, step.view, rank=1)
    rows = codec.rows(buf_np, 3)
    np.testing.assert_array_equal(rows[:, :w], step.tokens_np)
    assert (rows[:, w:4] == -1).all()
    np.testing.assert_array_equal(rows[:, 4], step.num_sampled_np)


@pytest.mark.parametrize("wire", ["fixed", "exact"])
def test_missing_drafts_clear_the_flag_and_columns(wire: WireMode) -> None:
    codec = _codec(3, wire)
    step = _step(codec, num_reqs=2, drafts=False)
    assert step.drafts_np is None
    buf_np = _pack(codec, step)
    flags = codec.check(buf_np, step.view, rank=0)
    assert not flags & FLAG_HAS_DRAFTS
    assert bool(flags & FLAG_EXACT) == (wire == "exact")
    assert (codec.drafts(codec.rows(buf_np, 2)) == -1).all()


def test_no_drafts_without_speculation() -> None:
    codec = _codec(0)
    step = _step(codec, num_reqs=3)
    assert step.drafts_np is None
    assert codec.check(_pack(codec, step), step.view, rank=0) == 0
    assert codec.rows(np.zeros(codec.words(3), dtype=np.int64), 3).shape == (3, 5)


def test_int32_inputs_are_widened() -> None:
    codec = _codec(1)
    step = _step(codec, num_reqs=2)
    assert step.drafts_np is not None
    step = Step(step.view, step.idx_np, step.tokens_np.astype(np.int32), step.num_sampled_np,
                step.num_rejected_np, step.drafts_np.astype(np.int32))
    buf_np = _pack(codec, step)
    codec.check(buf_np, step.view, rank=0)
    np.testing.assert_array_equal(codec.rows(buf_np, 2)[:, :2], step.tokens_np)


def test_empty_step_round_trip() -> None:
    codec = _codec(2, "exact")
    step = _step(codec, num_reqs=0)
    buf_np = _pack(codec, step)
    assert buf_np.shape == (HEADER_WORDS,)
    assert codec.check(buf_np, step.view, rank=0) == FLAG_EXACT | FLAG_HAS_DRAFTS


def test_many_random_frames_round_trip_without_warnings() -> None:
    # The checksum is int64 arithmetic that wraps by design: numpy must not warn
    # (pytest turns warnings into errors) whatever the words are.
    codec = _codec(2)
    for seed in range(64):
        step = _step(codec, seq=seed, num_reqs=1 + seed % MAX_NUM_REQS, seed=seed)
        buf_np = _pack(codec, step)
        assert codec.check(buf_np, step.view, rank=0) == FLAG_HAS_DRAFTS


def test_unused_rows_of_a_fixed_frame_are_not_checked() -> None:
    codec = _codec(1)
    step = _step(codec, num_reqs=2)
    buf_np = _pack(codec, step)
    used = HEADER_WORDS + 2 * codec.row_width
    buf_np[used:] = 12345
    assert codec.check(buf_np, step.view, rank=0) == FLAG_HAS_DRAFTS


# -- check failures ------------------------------------------------------------


def _desync(codec: NumpyFrames, buf_np: np.ndarray, view: FrameView, match: str) -> DesyncError:
    with pytest.raises(DesyncError, match=match) as info:
        codec.check(buf_np, view, rank=2)
    err = info.value
    assert str(err).startswith("rank 2: ")
    assert err.expected["version"] == FRAME_FORMAT_VERSION
    return err


def test_wrong_seq_shows_both_views() -> None:
    codec = _codec(2)
    step = _step(codec, seq=5)
    buf_np = _pack(codec, step)
    mine = FrameView(6, step.view.num_reqs, step.view.idx_digest)
    err = _desync(codec, buf_np, mine, r"seq: mine 6 vs sender 5")
    assert err.expected["seq"] == 6
    assert err.received["seq"] == 5
    # only the disagreeing field is listed
    assert "num_reqs:" not in str(err)
    assert err.expected["num_reqs"] == err.received["num_reqs"] == step.view.num_reqs


def test_wrong_num_reqs_shows_both_views() -> None:
    codec = _codec(2)  # fixed wire: both sides' buffers have one shape
    step = _step(codec, num_reqs=3)
    buf_np = _pack(codec, step)
    mine = FrameView(step.view.seq, 4, step.view.idx_digest)
    err = _desync(codec, buf_np, mine, r"num_reqs: mine 4 vs sender 3")
    assert err.expected["num_reqs"] == 4
    assert err.received["num_reqs"] == 3


def test_wrong_idx_digest_shows_both_views() -> None:
    codec = _codec(2)
    step = _step(codec, num_reqs=3)
    buf_np = _pack(codec, step)
    other = codec.facts_digest(_facts(step.idx_np[::-1].copy()))
    mine = FrameView(step.view.seq, 3, other)
    err = _desync(
        codec, buf_np, mine, rf"idx_digest: mine {other} vs sender {step.view.idx_digest}"
    )
    assert err.expected["idx_digest"] == other
    assert err.received["idx_digest"] == step.view.idx_digest


def test_several_disagreements_are_all_listed() -> None:
    codec = _codec(0)
    step = _step(codec, seq=1, num_reqs=2)
    buf_np = _pack(codec, step)
    err = _desync(codec, buf_np, FrameView(9, 5, step.view.idx_digest + 1),
                  r"seq: mine 9 vs sender 1, num_reqs: mine 5 vs sender 2, idx_digest:")
    assert err.received["seq"] == 1


def test_other_speculation_width_is_a_desync() -> None:
    sender = _codec(3)
    receiver = _codec(2)
    step = _step(sender, num_reqs=2)
    buf_np = _pack(sender, step)
    err = _desync(receiver, buf_np, step.view,
                  r"sample_width: mine 3 vs sender 4, num_drafts: mine 2 vs sender 3")
    assert err.expected["num_drafts"] == 2
    assert err.received["num_drafts"] == 3


def test_a_per_step_width_travels_in_the_header() -> None:
    codec = _codec(3)  # L = 4
    step = _step(codec, num_reqs=2, w=1)
    narrow = FrameView(step.view.seq, 2, step.view.idx_digest, sample_width=1)
    buf_np = BufferPool(codec).take(2).numpy()
    codec.pack(buf_np, narrow, step.tokens_np, step.num_sampled_np, step.num_rejected_np, None)
    assert codec.header_dict(buf_np)["sample_width"] == 1
    assert codec.check(buf_np, narrow, rank=0) == 0
    # a receiver that thinks the step is L wide (or another width) is told so
    _desync(codec, buf_np, step.view, r"sample_width: mine 4 vs sender 1")
    wide = FrameView(step.view.seq, 2, step.view.idx_digest, sample_width=2)
    err = _desync(codec, buf_np, wide, r"sample_width: mine 2 vs sender 1")
    assert err.expected["sample_width"] == 2


def test_bad_magic_is_a_version_desync() -> None:
    codec = _codec(1)
    step = _step(codec)
    buf_np = _pack(codec, step)
    buf_np[0] = 0  # not a ppsync frame at all
    err = _desync(codec, buf_np, step.view, rf"version: mine {FRAME_FORMAT_VERSION} vs sender -1")
    assert err.received["version"] == -1


@pytest.mark.parametrize("wire", ["fixed", "exact"])
@pytest.mark.parametrize("k", [0, 3])
def test_any_flipped_payload_word_fails_the_checksum(k: int, wire: WireMode) -> None:
    codec = _codec(k, wire)
    step = _step(codec, seq=4, num_reqs=3)
    buf_np = _pack(codec, step)
    used = HEADER_WORDS + 3 * codec.row_width
    for pos in range(HEADER_WORDS, used):
        bad = buf_np.copy()
        bad[pos] ^= 1 << (pos % 63)
        err = _desync(codec, bad, step.view, r"frame seq 4 fails its payload checksum")
        # the header agrees; both views are still shown
        assert err.expected["seq"] == err.received["seq"] == 4
        assert "checksum" in err.received


def test_flipped_flags_word_fails_the_checksum() -> None:
    codec = _codec(2)
    step = _step(codec)
    buf_np = _pack(codec, step)
    buf_np[5] ^= FLAG_HAS_DRAFTS  # the flags word is not compared, only checksummed
    _desync(codec, buf_np, step.view, r"fails its payload checksum")


def test_corrupt_checksum_word_fails() -> None:
    codec = _codec(2)
    step = _step(codec)
    buf_np = _pack(codec, step)
    buf_np[HEADER_WORDS - 1] ^= 1
    err = _desync(codec, buf_np, step.view, r"fails its payload checksum")
    assert err.received["checksum"] == int(buf_np[HEADER_WORDS - 1])


# -- row facts: what decides which rows need a sample ---------------------------


def _with_facts(view: FrameView, slot_need_np: np.ndarray, computed_np: np.ndarray) -> FrameView:
    return FrameView(view.seq, view.num_reqs, view.idx_digest, slot_need_np, computed_np)


def test_need_bit_disagreement_names_row_and_field() -> None:
    # a receiver whose prefill_len for row 1 is 12 where the sender's is 4:
    # the sender samples the row, the receiver thinks it needs no sample
    codec = _codec(2)
    step = _step(codec, num_reqs=3)
    buf_np = _pack(codec, step)
    assert step.view.slot_need_np is not None and step.view.computed_np is not None
    mine = step.view.slot_need_np.copy()
    mine[1] ^= 1
    err = _desync(codec, buf_np, _with_facts(step.view, mine, step.view.computed_np),
                  rf"row 1 disagrees with this rank's view: need_sampled\[1\] mine "
                  rf"{mine[1] & 1} vs sender {1 - (mine[1] & 1)}")
    assert err.expected["row"] == err.received["row"] == 1
    assert err.expected["need_sampled"] != err.received["need_sampled"]


def test_slot_disagreement_names_row_and_both_slots() -> None:
    codec = _codec(0)
    step = _step(codec, num_reqs=3)
    buf_np = _pack(codec, step)
    assert step.view.slot_need_np is not None and step.view.computed_np is not None
    mine = step.view.slot_need_np.copy()
    theirs = int(step.idx_np[2])
    other = (theirs + 1) % codec.max_num_reqs
    mine[2] = slot_need_words(np.array([other]), np.array([mine[2] & 1]))[0]
    _desync(codec, buf_np, _with_facts(step.view, mine, step.view.computed_np),
            rf"idx_mapping\[2\] mine {other} vs sender {theirs}")


def test_computed_disagreement_names_row() -> None:
    codec = _codec(1)
    step = _step(codec, num_reqs=4)
    buf_np = _pack(codec, step)
    assert step.view.slot_need_np is not None and step.view.computed_np is not None
    computed = step.view.computed_np.copy()
    computed[3] += 1
    _desync(codec, buf_np, _with_facts(step.view, step.view.slot_need_np, computed),
            rf"num_computed_tokens\[3\] mine {computed[3]} vs sender {computed[3] - 1}")


# -- idx digest ------------------------------------------------------------------


def test_digest_is_deterministic_across_codecs() -> None:
    facts = _facts(np.array([4, 0, 2], dtype=np.int64), computed=np.array([7, 0, 9]))
    assert _codec(0).facts_digest(facts) == _codec(3, "exact").facts_digest(facts)


def test_digest_differs_for_permuted_idx_mapping() -> None:
    codec = _codec()
    idx = np.array([4, 0, 2, 5], dtype=np.int64)
    digests = {codec.facts_digest(_facts(idx))}
    rng = np.random.default_rng(7)
    perms = {tuple(int(x) for x in rng.permutation(idx)) for _ in range(40)}
    perms.discard(tuple(int(x) for x in idx))
    for perm in perms:
        digests.add(codec.facts_digest(_facts(np.array(perm, dtype=np.int64))))
    assert len(digests) == len(perms) + 1


def test_digest_tells_apart_prefixes_zero_slots_need_bits_and_counts() -> None:
    codec = _codec()

    def d(idx: list[int], need: list[bool] | None = None, computed: list[int] | None = None
          ) -> int:
        return codec.facts_digest(_facts(
            np.array(idx, dtype=np.int64), None if need is None else np.array(need),
            None if computed is None else np.array(computed, dtype=np.int64)))
    assert d([0], [False]) != d([])
    assert d([0, 1]) != d([0])
    assert d([1, 2]) != d([1, 3])
    assert d([1, 2], [True, True]) != d([1, 2], [True, False])
    assert d([1, 2], computed=[5, 6]) != d([1, 2], computed=[5, 7])


def _wrap64(x: int) -> int:
    return (x + (1 << 63)) % (1 << 64) - (1 << 63)


@pytest.mark.parametrize("k", [0, 3])
def test_checksum_and_digest_are_the_documented_weighted_sums(k: int) -> None:
    """The folded forms (one dot over header + payload; facts . w + sum(w)
    for the digest) give the documented sums exactly, wrapped to int64, at any
    num_reqs and with words anywhere in int64 (Python-int reference)."""
    codec = _codec(k)
    rng = np.random.default_rng(k)
    for n in (0, 1, MAX_NUM_REQS // 2, MAX_NUM_REQS):
        buf = rng.integers(-(1 << 63), (1 << 63) - 1, size=codec.words(n), dtype=np.int64)
        m = n * codec.row_width
        want = sum(int(a) * int(b) for a, b in zip(
            buf[HEADER_WORDS:HEADER_WORDS + m], codec.payload_w[:m], strict=True))
        want += sum(int(a) * int(b) for a, b in zip(buf[:7], codec.header_w[:7], strict=True))
        assert codec.checksum(buf, n) == _wrap64(want)
        facts = rng.integers(-(1 << 63), (1 << 63) - 1, size=(2, n), dtype=np.int64)
        digest = sum((int(f) + 1) * int(w)
                     for f, w in zip(facts.reshape(-1), codec.facts_w, strict=False))
        assert codec.facts_digest(facts) == _wrap64(digest)
