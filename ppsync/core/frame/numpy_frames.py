"""Frames packed and checked in numpy, on the host (layout: ppsync.core.frame.layout).

Also the error path of the device codec: once a device verdict says a frame
is bad, its host copy is checked here to name what and where.
"""

from __future__ import annotations

import struct
from typing import NoReturn

import numpy as np

from ppsync.core.frame.layout import (
    FLAG_HAS_DRAFTS,
    FRAME_FORMAT_VERSION,
    HEADER_WORDS,
    MAGIC,
    FrameLayout,
    FrameView,
    Header,
)
from ppsync.errors import DesyncError

_H_MAGIC, _H_SEQ, _H_NREQS, _H_WIDTH, _H_K, _H_FLAGS, _H_DIGEST, _H_CSUM = (
    int(h) for h in Header)  # plain ints: indexing with them costs less than with the enum
_HEAD = struct.Struct(f"={_H_CSUM}q")
"""The header words before the checksum, as pack writes them."""


class NumpyFrames(FrameLayout):
    """Packs and checks host frames for one configuration."""

    def facts_digest(self, facts_np: np.ndarray) -> int:
        """Digest of a step's row facts, [2, num_reqs] int64 (slot_need then
        num_computed_tokens, see ppsync.core.rules.facts): the token path's
        idx_digest, in one dot product. It covers each row's request slot,
        need bit and computed count, so views that differ in any give
        different digests (the rows themselves are then compared to name the
        row)."""
        flat = facts_np.reshape(-1)
        n = flat.shape[0]
        # sum((f + 1) * w) = f . w + sum(w): a row of zeros still counts. The
        # dot wraps silently; the sum is a Python int, wrapped to int64 here
        digest = int(np.dot(flat, self.facts_w[:n])) + int(self.facts_w_sums[n])
        return (digest + (1 << 63)) % (1 << 64) - (1 << 63)

    def checksum(self, buf_np: np.ndarray, num_reqs: int) -> int:
        """The frame's checksum: header . header_w + payload . payload_w in one
        dot (the checksum word itself is weighted 0); int64 arithmetic wraps
        mod 2**64 by design."""
        end = self.used(num_reqs)
        return int(np.dot(buf_np[:end], self.frame_w[:end]))

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
        cols = self.columns
        n, tok = view.num_reqs, cols.tokens
        rows = self.rows(buf_np, n)
        w = tokens_np.shape[1]
        rows[:, tok.offset : tok.offset + w] = tokens_np
        if w < tok.width:
            rows[:, tok.offset + w : tok.end] = -1
        rows[:, cols.num_sampled.offset] = num_sampled_np
        rows[:, cols.num_rejected.offset] = num_rejected_np
        if self.num_drafts:
            self.drafts(rows)[:] = -1 if drafts_np is None else drafts_np
        flags = self.flags(self.num_drafts > 0 and drafts_np is not None)
        # two 1-D copies: cheaper than numpy's [n, 2] strided copy
        rows[:, cols.slot_need.offset] = 0 if view.slot_need_np is None else view.slot_need_np
        rows[:, cols.num_computed.offset] = 0 if view.computed_np is None else view.computed_np
        self.clear_spare(buf_np, n)
        # one C call, cheaper than numpy's tuple assignment: native int64
        # words, as the buffer's own
        _HEAD.pack_into(buf_np, 0, MAGIC | FRAME_FORMAT_VERSION, view.seq, n,  # type: ignore[arg-type]
                        view.width(self), self.num_drafts, flags, view.idx_digest)
        checksum = self.checksum(buf_np, n)
        buf_np[_H_CSUM] = checksum
        return flags, checksum

    def check(self, buf_np: np.ndarray, view: FrameView, *, rank: int) -> int:
        """Verify a received frame against this rank's view of the step.

        Returns the header's flags; raises :class:`DesyncError` showing both
        views when anything disagrees: the header's shape words, the payload
        checksum, a row's facts (naming the row and field), the digest."""
        head = buf_np[:HEADER_WORDS].tolist()  # Python ints: cheaper to compare one by one
        n = view.num_reqs
        if not (
            head[_H_MAGIC] == (MAGIC | FRAME_FORMAT_VERSION)
            and head[_H_SEQ] == view.seq
            and head[_H_NREQS] == n
            and head[_H_WIDTH] == view.width(self)
            and head[_H_K] == self.num_drafts
        ):
            self._raise_header(buf_np, view, rank)
        if head[_H_CSUM] != self.checksum(buf_np, n):
            got = self.header_dict(buf_np)
            raise DesyncError(
                f"rank {rank}: frame seq {view.seq} fails its payload checksum "
                f"(header says {got['checksum']}, payload gives {self.checksum(buf_np, n)})",
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
                view.facts_np != rows[:, self.columns.facts].T):
            return  # the usual case, in two numpy calls (count_nonzero is cheaper than any)
        cols = self.columns
        theirs_sn, theirs_c = rows[:, cols.slot_need.offset], rows[:, cols.num_computed.offset]
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

    def has_drafts(self, buf_np: np.ndarray) -> bool:
        """Whether a host frame's FLAG_HAS_DRAFTS is set."""
        return bool(int(buf_np[_H_FLAGS]) & FLAG_HAS_DRAFTS)


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
