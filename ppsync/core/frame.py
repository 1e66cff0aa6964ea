"""One frame per step: header, tokens, counts and drafts in one int64 buffer.

Layout (int64 words)::

    header  [HEADER_WORDS]            magic|version, seq, num_reqs, w, K, flags,
                                      idx_digest, checksum
    rows    [R, W], W = L + 4 + K     tokens[L], num_sampled, num_rejected, drafts[K],
                                      slot_need, num_computed

Each row ends with the sender's facts about it: ``slot_need = 2 * idx + need``
(its request slot index and whether it needed a sample) and its
``num_computed_tokens``: what decides, on every rank, which rows need a
sample. A receiver compares them with its own view, so two ranks that
disagree about one row (another prefill_len, say) get a DesyncError naming
that row, the field and both values, instead of a placeholder kept as a token
or a real token dropped.

w is the step's sample width: L unless the engine varies it per step
(tokens beyond w are -1 padding). R is max_num_reqs in the fixed wire mode
(every frame of a group has one shape, so ranks that disagree about num_reqs
cannot deadlock or tear the collective: the header check names the
disagreement instead) and num_reqs in the exact mode. Row-major rows keep a
step's used payload contiguous, so the checksum is one dot product over
``num_reqs * W`` words.

``seq`` counts frames sent on the group (steps with no transfer send none),
so an engine that skips calls on empty steps keeps its ranks in agreement.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import NoReturn

import numpy as np
import torch

from ppsync.errors import BatchError, DesyncError
from ppsync.schemas.config import SyncConfig
from ppsync.schemas.records import FLAG_EXACT, FLAG_HAS_DRAFTS, FRAME_FORMAT_VERSION

HEADER_WORDS = 8
_MAGIC = 0x50505359 << 8  # "PPSY"
_H_MAGIC, _H_SEQ, _H_NREQS, _H_L, _H_K, _H_FLAGS, _H_DIGEST, _H_CSUM = range(HEADER_WORDS)
_HEAD = struct.Struct(f"={_H_CSUM}q")
"""The header words before the checksum, as pack writes them."""
_HEADER_NAMES = ("version", "seq", "num_reqs", "sample_width", "num_drafts", "flags",
                 "idx_digest", "checksum")


def _weights(n: int, salt: int) -> np.ndarray:
    """[n] int64 odd multipliers, the same on every rank (no RNG involved)."""
    i = np.arange(n, dtype=np.uint64) + np.uint64(salt)
    with np.errstate(over="ignore"):
        w = (i * np.uint64(0x9E3779B97F4A7C15)) ^ (i >> np.uint64(7))
    return (w | np.uint64(1)).view(np.int64)


def slot_need_words(idx_np: np.ndarray, need_np: np.ndarray) -> np.ndarray:
    """[num_reqs] int64: ``2 * idx + need`` per row (the frame's slot_need column)."""
    words: np.ndarray = idx_np.astype(np.int64)  # a fresh array
    words *= 2
    words += need_np
    return words


@dataclass(slots=True)  # read-only by convention: frozen costs ~1 µs per step
class FrameView:
    """What a rank expects of a frame: its own view of the step. The row
    facts (None in raw benchmark frames only) are checked row by row."""

    seq: int
    num_reqs: int
    idx_digest: int
    slot_need_np: np.ndarray | None = None  # [num_reqs] int64, see slot_need_words
    computed_np: np.ndarray | None = None  # [num_reqs] int, num_computed_tokens
    sample_width: int | None = None
    """The step's sample width w, 1 <= w <= L, for engines whose width varies
    per step (vLLM 0.33: 1 without drafts); None = L. The header carries it,
    so a receiver that disagrees gets a DesyncError, never cut tokens."""
    facts_np: np.ndarray | None = None
    """[2, num_reqs] int64, rows slot_need_np then computed_np, when the two
    are rows of one array (the token path's): compared with the frame's last
    two columns in one numpy call instead of three."""

    def width(self, codec: FrameCodec) -> int:
        return codec.sample_width if self.sample_width is None else self.sample_width

    def as_dict(self, codec: FrameCodec) -> dict[str, int]:
        return {
            "version": FRAME_FORMAT_VERSION,
            "seq": self.seq,
            "num_reqs": self.num_reqs,
            "sample_width": self.width(codec),
            "num_drafts": codec.num_drafts,
            "idx_digest": self.idx_digest,
        }


class FrameCodec:
    """Packs and checks frames for one configuration."""

    def __init__(self, config: SyncConfig) -> None:
        self.max_num_reqs = config.max_num_reqs
        self.sample_width = config.sample_width  # L
        self.num_drafts = config.num_speculative_steps  # K
        L, K = self.sample_width, self.num_drafts
        self.col_drafts = L + 2  # drafts[K] start here
        self.col_slot_need = L + 2 + K
        self.col_computed = L + 3 + K
        self.row_width = L + 4 + K  # W
        self.exact = config.wire == "exact"
        self._payload_w = _weights(self.max_num_reqs * self.row_width, salt=1)
        self._header_w = _weights(HEADER_WORDS, salt=1 << 40)
        self._facts_w = _weights(2 * self.max_num_reqs, salt=1 << 57)
        with np.errstate(over="ignore"):
            # digest of facts + 1 = digest of facts + sum of the weights: no per-step add
            self._facts_w_sums = np.concatenate(([0], np.cumsum(self._facts_w)))
        # header (checksum word weighted 0) and payload weights in one vector,
        # so the checksum is one dot product over the frame's used prefix; it
        # equals the header's dot plus the payload's (the device codec's sum)
        self._frame_w = np.concatenate(
            (self._header_w[:_H_CSUM], [0], self._payload_w)).astype(np.int64)
        self._free: list[torch.Tensor] = []  # recycled fixed-size frame buffers

    def words(self, num_reqs: int) -> int:
        """Frame length in int64 words for a step of ``num_reqs`` rows."""
        rows = num_reqs if self.exact else self.max_num_reqs
        return HEADER_WORDS + rows * self.row_width

    def new_buffer(self, num_reqs: int) -> torch.Tensor:
        """A CPU frame buffer, reused from :meth:`recycle` when one of the
        right size is free (allocating one costs ~12 µs inside a busy rank);
        ``.numpy()`` shares its memory."""
        words = self.words(num_reqs)
        if self._free and self._free[-1].shape[0] == words:
            return self._free.pop()
        return torch.empty(words, dtype=torch.int64)

    def recycle(self, buf: torch.Tensor) -> None:
        """Give back a buffer whose transfer has completed and whose contents
        were copied out. Only fixed-size frames are kept (a few at most)."""
        if not self.exact and len(self._free) < 8:
            self._free.append(buf)

    def facts_digest(self, facts_np: np.ndarray) -> int:
        """Digest of a step's row facts, [2, num_reqs] int64 (slot_need then
        num_computed_tokens, see ppsync.core.facts): the token path's
        idx_digest, in one dot product. It covers each row's request slot,
        need bit and computed count, so views that differ in any give
        different digests (the rows themselves are then compared to name the
        row)."""
        flat = facts_np.reshape(-1)
        n = flat.shape[0]
        # sum((f + 1) * w) = f . w + sum(w): a row of zeros still counts. The
        # dot wraps silently; the sum is a Python int, wrapped to int64 here
        digest = int(np.dot(flat, self._facts_w[:n])) + int(self._facts_w_sums[n])
        return (digest + (1 << 63)) % (1 << 64) - (1 << 63)

    def rows(self, buf_np: np.ndarray, num_reqs: int) -> np.ndarray:
        """[num_reqs, W] view of the used rows."""
        end = HEADER_WORDS + num_reqs * self.row_width
        return buf_np[HEADER_WORDS:end].reshape(num_reqs, self.row_width)

    def _checksum(self, buf_np: np.ndarray, num_reqs: int) -> int:
        end = HEADER_WORDS + num_reqs * self.row_width
        # header . header_w + payload . payload_w in one dot (the checksum word
        # itself is weighted 0); int64 arithmetic wraps mod 2**64 by design
        return int(np.dot(buf_np[:end], self._frame_w[:end]))

    def pack(
        self,
        buf_np: np.ndarray,  # [words] int64
        view: FrameView,
        tokens_np: np.ndarray,  # [num_reqs, w] int, 1 <= w <= L
        num_sampled_np: np.ndarray,  # [num_reqs] int
        num_rejected_np: np.ndarray,  # [num_reqs] int
        drafts_np: np.ndarray | None,  # [num_reqs, K] int, None = no drafts
    ) -> tuple[int, int]:
        """Write one step into ``buf_np`` (inputs already validated); return
        the header's (flags, checksum)."""
        n, L = view.num_reqs, self.sample_width
        rows = self.rows(buf_np, n)
        w = tokens_np.shape[1]
        rows[:, :w] = tokens_np
        if w < L:
            rows[:, w:L] = -1
        rows[:, L] = num_sampled_np
        rows[:, L + 1] = num_rejected_np
        flags = FLAG_EXACT if self.exact else 0
        if self.num_drafts:
            if drafts_np is None:
                rows[:, self.col_drafts : self.col_slot_need] = -1
            else:
                rows[:, self.col_drafts : self.col_slot_need] = drafts_np
                flags |= FLAG_HAS_DRAFTS
        # two 1-D copies: numpy's [n, 2] strided copy costs twice their sum
        rows[:, self.col_slot_need] = 0 if view.slot_need_np is None else view.slot_need_np
        rows[:, self.col_computed] = 0 if view.computed_np is None else view.computed_np
        # one C call (numpy's tuple assignment costs ~5x): native int64 words,
        # as the buffer's own
        _HEAD.pack_into(buf_np, 0, _MAGIC | FRAME_FORMAT_VERSION, view.seq, n,  # type: ignore[arg-type]
                        view.width(self), self.num_drafts, flags, view.idx_digest)
        checksum = self._checksum(buf_np, n)
        buf_np[_H_CSUM] = checksum
        return flags, checksum

    def drafts(self, rows: np.ndarray) -> np.ndarray:
        """[num_reqs, K] view of the draft columns of ``rows``."""
        return rows[:, self.col_drafts : self.col_slot_need]

    def header_dict(self, buf_np: np.ndarray) -> dict[str, int]:
        """The header words by name (version decoded from the magic word)."""
        words = [int(x) for x in buf_np[:HEADER_WORDS]]
        out = dict(zip(_HEADER_NAMES, words, strict=True))
        magic = out["version"]
        out["version"] = magic & 0xFF if magic & ~0xFF == _MAGIC else -1
        return out

    def check(self, buf_np: np.ndarray, view: FrameView, *, rank: int) -> int:
        """Verify a received frame against this rank's view of the step.

        Returns the header's flags; raises :class:`DesyncError` showing both
        views when anything disagrees: the header's shape words, the payload
        checksum, a row's facts (naming the row and field), the digest."""
        head = buf_np[:HEADER_WORDS].tolist()  # Python ints: cheaper to compare one by one
        n = view.num_reqs
        if not (
            head[_H_MAGIC] == (_MAGIC | FRAME_FORMAT_VERSION)
            and head[_H_SEQ] == view.seq
            and head[_H_NREQS] == n
            and head[_H_L] == view.width(self)
            and head[_H_K] == self.num_drafts
        ):
            self._raise_header(buf_np, view, rank)
        if head[_H_CSUM] != self._checksum(buf_np, n):
            got = self.header_dict(buf_np)
            raise DesyncError(
                f"rank {rank}: frame seq {view.seq} fails its payload checksum "
                f"(header says {got['checksum']}, payload gives {self._checksum(buf_np, n)})",
                expected=view.as_dict(self),
                received=got,
            )
        self._check_rows(buf_np, view, rank)
        if head[_H_DIGEST] != view.idx_digest:
            self._raise_header(buf_np, view, rank)
        flags: int = head[_H_FLAGS]  # an int already (tolist)
        return flags

    def _check_rows(self, buf_np: np.ndarray, view: FrameView, rank: int) -> None:
        """Raise DesyncError naming the first row whose facts (request slot,
        need bit, num_computed_tokens) differ between the frame and ``view``."""
        if view.slot_need_np is None or view.computed_np is None:
            return
        rows = self.rows(buf_np, view.num_reqs)
        if view.facts_np is not None and not np.count_nonzero(
                view.facts_np != rows[:, self.col_slot_need:].T):
            return  # the usual case, in two numpy calls (any() is 4x count_nonzero)
        theirs_sn, theirs_c = rows[:, self.col_slot_need], rows[:, self.col_computed]
        differs = (theirs_sn != view.slot_need_np) | (theirs_c != view.computed_np)
        if not differs.any():
            return
        row = int(np.argmax(differs))
        mine_sn, got_sn = int(view.slot_need_np[row]), int(theirs_sn[row])
        mine_c, got_c = int(view.computed_np[row]), int(theirs_c[row])
        if mine_sn >> 1 != got_sn >> 1:
            field, mine_v, got_v = "idx_mapping", mine_sn >> 1, got_sn >> 1
        elif mine_sn != got_sn:
            field, mine_v, got_v = "need_sampled", mine_sn & 1, got_sn & 1
        else:
            field, mine_v, got_v = "num_computed_tokens", mine_c, got_c
        what = {"need_sampled": " (whether the row produces a sample: num_computed_tokens "
                "+ num_scheduled_tokens >= prefill_len, and the max_seq_len cap)"}.get(field, "")
        expected = {**view.as_dict(self), "row": row, field: mine_v}
        received = {**self.header_dict(buf_np), "row": row, field: got_v}
        raise DesyncError(
            f"rank {rank}: frame seq {view.seq} row {row} disagrees with this rank's view: "
            f"{field}[{row}] mine {mine_v} vs sender {got_v}{what}",
            expected=expected, received=received,
        )

    def _raise_header(self, buf_np: np.ndarray, view: FrameView, rank: int) -> NoReturn:
        got = self.header_dict(buf_np)
        mine = view.as_dict(self)
        diffs = ", ".join(
            f"{k}: mine {v} vs sender {got[k]}" for k, v in mine.items() if got.get(k) != v
        )
        raise DesyncError(
            f"rank {rank}: frame disagrees with this rank's view of the step ({diffs})",
            expected=mine,
            received=got,
        )


def check_sample_width(sample_width: int | None, L: int) -> None:
    """A step's own sample width: None (= L) or an int in [1, L]."""
    if sample_width is None:
        return
    if isinstance(sample_width, bool) or not isinstance(sample_width, int):
        raise BatchError(f"sample_width = {sample_width!r} must be an int or None")
    if not 1 <= sample_width <= L:
        raise BatchError(f"sample_width = {sample_width} must lie in [1, L = {L}] "
                         "(L = num_speculative_steps + 1)")


def drafts_desync(
    rank: int, seq: int, expected: bool, has_drafts: bool, header: dict[str, int]
) -> DesyncError:
    """A frame whose FLAG_HAS_DRAFTS disagrees with what its receiver expected."""
    want, got = ("drafts", "none") if expected else ("no drafts", "drafts")
    return DesyncError(
        f"rank {rank}: frame seq {seq}: this rank expects {want} (expect_drafts = "
        f"{expected}; vLLM's recv_drafts) but the last rank sent {got} "
        f"(FLAG_HAS_DRAFTS {'set' if has_drafts else 'clear'})",
        expected={"seq": seq, "has_drafts": int(expected)},
        received={**header, "has_drafts": int(has_drafts)},
    )
