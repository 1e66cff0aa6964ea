"""The frame's layout: one int64 buffer per step, defined here and nowhere else.

Layout (int64 words)::

    header  [HEADER_WORDS]            Header: magic|version, seq, num_reqs, w, K, flags,
                                      idx_digest, checksum
    rows    [R, W], W = L + 4 + K     tokens[L], num_sampled, num_rejected, drafts[K],
                                      slot_need, num_computed

The row's columns are declared once, in order, in ``ROW_COLUMNS``
(ppsync.core.frame.rows, beside the records that carry a step's rows);
``row_columns`` lays them out into a :class:`Columns` (each column's offset
and width, and W), and every kernel set (numpy, numba, torch ops, Triton)
reads its offsets from that object: none restates one. A declared column
that no field of ``Columns`` names (reserved, not yet filled by any kernel)
is packed as 0 by every kernel set, so a new column can be declared first
and filled after.

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

The checksum is a weighted sum of the header (its own word weighted 0) and
the used payload, in int64 arithmetic that wraps mod 2**64 in numpy and
torch alike: both codecs compute it from the weights built here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from enum import IntEnum

import numpy as np
import torch

from ppsync.core.frame import rows as declared
from ppsync.schemas.config import SyncConfig

FRAME_FORMAT_VERSION = 3
"""Receivers reject a frame of another version (the header's magic word)."""

MAGIC = 0x50505359 << 8  # "PPSY"; the low byte holds the version

FLAG_HAS_DRAFTS = 1
"""The frame's draft columns hold this step's drafts."""
FLAG_EXACT = 2
"""The frame is sized for num_reqs rows, not max_num_reqs."""
FLAG_BAD_VALUES = 4
"""The device codec found a num_sampled or num_rejected value out of range
while packing (its checks run on the device, after the step was issued);
every receiver raises on such a frame."""


class Header(IntEnum):
    """The header words, by position."""

    MAGIC = 0  # MAGIC | FRAME_FORMAT_VERSION
    SEQ = 1
    NUM_REQS = 2
    SAMPLE_WIDTH = 3  # w
    NUM_DRAFTS = 4  # K
    FLAGS = 5
    DIGEST = 6  # idx_digest: the row facts' digest
    CHECKSUM = 7


HEADER_WORDS = len(Header)
HEADER_NAMES = ("version", "seq", "num_reqs", "sample_width", "num_drafts", "flags",
                "idx_digest", "checksum")
"""The header words by name, in order (``version`` decoded from the magic word)."""


def weights(n: int, salt: int) -> np.ndarray:
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


@dataclass(frozen=True, slots=True)
class Column:
    """One column of a row: ``width`` words from word ``offset``."""

    offset: int
    width: int

    @property
    def end(self) -> int:
        """The word after the column."""
        return self.offset + self.width


@dataclass(frozen=True, slots=True)
class Columns:
    """Where each column of a row lies (laid out by :func:`row_columns`)."""

    tokens: Column  # [L]
    num_sampled: Column  # [1]
    num_rejected: Column  # [1]
    drafts: Column  # [K]
    slot_need: Column  # [1]
    num_computed: Column  # [1]
    spare: tuple[Column, ...]
    """Declared columns that no field names: every kernel set packs them as 0."""
    row_width: int
    """W: the words of a row."""
    counts: slice
    """num_sampled and num_rejected, adjacent: the kernels read them as one [n, 2] block."""
    facts: slice
    """slot_need and num_computed, adjacent: one [n, 2] block, as Staging holds them."""


# the columns Columns names (its annotations are strings here: __future__)
_NAMED = frozenset(f.name for f in fields(Columns) if f.type == "Column")


def row_columns(L: int, K: int) -> Columns:
    """The columns of ``ROW_COLUMNS`` laid out in order, for a sample width
    ``L`` and ``K`` drafts."""
    sizes = {"L": L, "K": K}
    at = 0
    named: dict[str, Column] = {}
    spare: list[Column] = []
    for name, width in declared.ROW_COLUMNS:
        col = Column(at, width if isinstance(width, int) else sizes[width])
        if name in _NAMED:
            named[name] = col
        else:
            spare.append(col)
        at = col.end
    for first, second in (("num_sampled", "num_rejected"), ("slot_need", "num_computed")):
        if named[second].offset != named[first].end:
            raise ValueError(f"ROW_COLUMNS: {second} must follow {first} (the kernels read "
                             "them as one [n, 2] block)")
    return Columns(**named, spare=tuple(spare), row_width=at,
                   counts=slice(named["num_sampled"].offset, named["num_rejected"].end),
                   facts=slice(named["slot_need"].offset, named["num_computed"].end))


class Staging:
    """The named regions of a device codec's host staging buffer (pinned on
    a device), offsets in int64 words for R = max_num_reqs. The whole buffer
    goes to the device in one copy per step; the kernels read it there:

    - ``[0, HEADER_WORDS)``: the header words this rank expects (the
      checksum word 0: the device computes it);
    - ``bounds [2]``: the step's largest valid num_sampled, num_rejected;
    - ``facts [n, 2]``: each row's slot_need and num_computed, interleaved
      as the frame's two adjacent facts columns hold them (Columns.facts);
    - ``idx_out [R]``, ``kept_slots [R]``, ``kept_rows [R]``: a receiver's
      consume: the idx_mapping handed out, the kept rows' request slots and
      the kept rows;
    - ``verdict``: the last word, the device verdict's host copy."""

    bounds = HEADER_WORDS
    facts_at = HEADER_WORDS + 2

    def __init__(self, max_num_reqs: int) -> None:
        R = max_num_reqs
        self.idx_out = self.facts_at + 2 * R
        self.kept_slots = self.idx_out + R
        self.kept_rows = self.kept_slots + R
        self.verdict = self.kept_rows + R
        self.words = self.verdict + 1

    @staticmethod
    def facts(n: int) -> slice:
        """The [n, 2] row facts, flat."""
        return slice(Staging.facts_at, Staging.facts_at + 2 * n)


class FrameLayout:
    """The layout's sizes, columns and checksum weights for one configuration."""

    def __init__(self, config: SyncConfig) -> None:
        self.max_num_reqs = config.max_num_reqs  # R in the fixed wire mode
        self.sample_width = L = config.sample_width
        self.num_drafts = K = config.num_speculative_steps
        self.columns = cols = row_columns(L, K)  # every column's offset: none restated here
        self.row_width = cols.row_width  # W
        self.exact = config.wire == "exact"
        self.staging = Staging(self.max_num_reqs)
        self.payload_w = weights(self.max_num_reqs * self.row_width, salt=1)
        self.header_w = weights(HEADER_WORDS, salt=1 << 40)
        self.header_w[Header.CHECKSUM] = 0  # the checksum does not cover itself
        self.facts_w = weights(2 * self.max_num_reqs, salt=1 << 57)
        with np.errstate(over="ignore"):
            # digest of facts + 1 = digest of facts + sum of the weights: no per-step add
            self.facts_w_sums = np.concatenate(([0], np.cumsum(self.facts_w)))
        # header and payload weights in one vector, so the checksum is one dot
        # product over the frame's used prefix
        self.frame_w = np.concatenate((self.header_w, self.payload_w)).astype(np.int64)

    def words(self, num_reqs: int) -> int:
        """Frame length in int64 words for a step of ``num_reqs`` rows."""
        rows = num_reqs if self.exact else self.max_num_reqs
        return HEADER_WORDS + rows * self.row_width

    def used(self, num_reqs: int) -> int:
        """Words of a frame's used prefix: the header and ``num_reqs`` rows."""
        return HEADER_WORDS + num_reqs * self.row_width

    def rows(self, buf: np.ndarray, num_reqs: int) -> np.ndarray:
        """[num_reqs, W] view of a host frame's used rows."""
        return buf[HEADER_WORDS : self.used(num_reqs)].reshape(num_reqs, self.row_width)

    def device_rows(self, buf: torch.Tensor, num_reqs: int) -> torch.Tensor:
        """[num_reqs, W] view of a device frame's used rows."""
        return buf[HEADER_WORDS : self.used(num_reqs)].view(num_reqs, self.row_width)

    def drafts(self, rows: np.ndarray) -> np.ndarray:
        """[num_reqs, K] view of the draft columns of ``rows``."""
        return rows[:, self.columns.drafts.offset : self.columns.drafts.end]

    def clear_spare(self, buf_np: np.ndarray, num_reqs: int) -> None:
        """Zero the spare columns of a host frame's used rows (none in the
        layout as declared: then this costs one attribute check)."""
        if self.columns.spare:
            rows = self.rows(buf_np, num_reqs)
            for col in self.columns.spare:
                rows[:, col.offset : col.end] = 0

    def flags(self, has_drafts: bool) -> int:
        """The flags a host sets on a frame (FLAG_BAD_VALUES is the device's)."""
        return (FLAG_EXACT if self.exact else 0) | (FLAG_HAS_DRAFTS if has_drafts else 0)

    def header_dict(self, buf_np: np.ndarray) -> dict[str, int]:
        """The header words by name (version decoded from the magic word)."""
        words = [int(x) for x in buf_np[:HEADER_WORDS]]
        out = dict(zip(HEADER_NAMES, words, strict=True))
        magic = out["version"]
        out["version"] = magic & 0xFF if magic & ~0xFF == MAGIC else -1
        return out


class BufferPool:
    """Fixed-size frame buffers on one device, reused once their transfer
    completed (a fresh one costs more than a step's packing inside a busy
    rank; docs/measured.md). Exact-wire frames vary in size: not kept."""

    def __init__(self, layout: FrameLayout, device: torch.device | None = None,
                 keep: int = 8, alloc: Callable[[int], torch.Tensor] | None = None) -> None:
        """``alloc(words)``: a fresh [words] int64 buffer (default: on
        ``device``; the host carrier's: pinned host memory)."""
        self.layout = layout
        self.device = device
        self.keep = 0 if layout.exact else keep
        self._alloc = alloc
        self._free: list[torch.Tensor] = []

    def take(self, num_reqs: int) -> torch.Tensor:
        """A [words] int64 frame buffer; on the host ``.numpy()`` shares its memory."""
        words = self.layout.words(num_reqs)
        if self._free and self._free[-1].shape[0] == words:
            return self._free.pop()
        if self._alloc is not None:
            return self._alloc(words)
        return torch.empty(words, dtype=torch.int64, device=self.device)

    def give(self, buf: torch.Tensor) -> None:
        """Give back a buffer whose transfer completed and whose contents
        were copied out."""
        if len(self._free) < self.keep:
            self._free.append(buf)


@dataclass(slots=True)  # read-only by convention: frozen costs the hot path (docs/measured.md)
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

    def width(self, layout: FrameLayout) -> int:
        return layout.sample_width if self.sample_width is None else self.sample_width

    def as_dict(self, layout: FrameLayout) -> dict[str, int]:
        return {
            "version": FRAME_FORMAT_VERSION,
            "seq": self.seq,
            "num_reqs": self.num_reqs,
            "sample_width": self.width(layout),
            "num_drafts": layout.num_drafts,
            "idx_digest": self.idx_digest,
        }

    def header_words(self, layout: FrameLayout, flags: int) -> tuple[int, ...]:
        """The header words before the checksum, as a sender writes them."""
        return (MAGIC | FRAME_FORMAT_VERSION, self.seq, self.num_reqs, self.width(layout),
                layout.num_drafts, flags, self.idx_digest)
