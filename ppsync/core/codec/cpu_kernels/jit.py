"""The numba kernels of the host codec's per-step work (imported only when
``cpu_kernels`` resolves to numba; ppsync.core.codec.cpu_kernels.numba_set calls
them).

Each kernel does in one compiled call what the numpy reference does in many
numpy calls, and answers with a code: 0 (or a non-negative result) when
every rule holds, negative when one does not, and then the numpy path runs
and raises its typed error, so every message is the reference's. They are
compiled for the signatures below when this module is imported (a token
path's construction, never inside a step), with ``cache=True``: numba keeps
the machine code next to this file, or in the user's cache directory where
the install is read-only, or in ``NUMBA_CACHE_DIR``. An argument of another
type matches no signature (numba raises TypeError, never compiles in a
step) and the numpy path serves the call.

Integer arithmetic is int64 and wraps mod 2**64, as numpy's does: the
digest and the checksum are the numpy path's values word for word.

The row's columns come in as one tuple of ints (:func:`column_words`, from
the layout's Columns), an argument like any other: one compiled function
serves every layout, and a plain tuple costs the call nothing measurable
(a NamedTuple would: numba types it in Python on every call).
"""

from __future__ import annotations

import numba as nb
import numpy as np

from ppsync.core.frame.layout import (
    FLAG_HAS_DRAFTS,
    HEADER_WORDS,
    Columns,
    Header,
    row_columns,
)

BAD = -1
"""Some rule failed: run the numpy path for the error."""
DRAFTS_DIFFER = -2
"""A received frame's FLAG_HAS_DRAFTS disagrees with what the receiver expects."""

_COUNT_LIMIT = 1 << 62  # ppsync.core.rules.validate.COUNT_LIMIT
_H = HEADER_WORDS  # module globals: constants in the compiled code
_FLAGS, _DIGEST, _CSUM = int(Header.FLAGS), int(Header.DIGEST), int(Header.CHECKSUM)
_HAS_DRAFTS = FLAG_HAS_DRAFTS
_OPTS = {"cache": True, "nogil": True, "boundscheck": False, "error_model": "numpy"}

_I64, _I32, _B1 = nb.int64, nb.int32, nb.boolean
_VIEW = [_I64[:], _I32[:]]  # a batch view's four arrays share one of these dtypes
_COUNTS = [_I64[:], _I32[:]]  # num_sampled and num_rejected share one
_DRAFTS = [_I64[:, :], _I32[:, :]]
_COLS = nb.types.UniTuple(_I64, 9)  # column_words


def column_words(cols: Columns) -> tuple[int, ...]:
    """The kernels' ``cols`` argument: offsets and widths, unpacked in this
    order at the top of each kernel that takes it."""
    return (cols.tokens.offset, cols.tokens.width, cols.num_sampled.offset,
            cols.num_rejected.offset, cols.drafts.offset, cols.drafts.width,
            cols.slot_need.offset, cols.num_computed.offset, cols.row_width)


# -- both roles: the batch view ---------------------------------------------

@nb.njit([nb.types.UniTuple(_I64, 2)(a, a, a, a, _I64, _I64[:, :], _B1[:], _I64[:], _I64[:])
          for a in _VIEW], **_OPTS)
def batch_facts(idx, computed, scheduled, prefill, max_num_reqs, block, need, facts_w,
                facts_w_sums):
    """Check a plain batch view (every slot in [0, max_num_reqs) and
    distinct, every count in [0, 2**62)), fill ``block`` [3, n] (idx,
    ``2 * idx + need``, computed) and ``need`` [n] (rule 1); return
    (rows needing a sample, the row facts' digest) or (BAD, 0)."""
    n = idx.shape[0]
    seen = np.zeros(max_num_reqs, np.uint8)
    needed = 0
    for i in range(n):
        s = np.int64(idx[i])
        c = np.int64(computed[i])
        sc = np.int64(scheduled[i])
        p = np.int64(prefill[i])
        if s < 0 or s >= max_num_reqs or seen[s]:
            return BAD, 0
        if (c < 0 or c >= _COUNT_LIMIT or sc < 0 or sc >= _COUNT_LIMIT
                or p < 0 or p >= _COUNT_LIMIT):
            return BAD, 0
        seen[s] = 1
        nd = c + sc >= p
        need[i] = nd
        needed += nd
        block[0, i] = s
        block[1, i] = 2 * s + nd
        block[2, i] = c
    # sum((f + 1) * w) over slot_need then computed: see NumpyFrames.facts_digest
    digest = facts_w_sums[2 * n]
    for i in range(n):
        digest += block[1, i] * facts_w[i] + block[2, i] * facts_w[n + i]
    return needed, digest


@nb.njit(**_OPTS)
def _checksum(buf, end, frame_w):
    """buf[:end] . frame_w[:end], the checksum word weighted 0."""
    csum = np.int64(0)
    for j in range(_CSUM):
        csum += buf[j] * frame_w[j]
    for j in range(_H, end):
        csum += buf[j] * frame_w[j]
    return csum


# -- the last rank ------------------------------------------------------------

@nb.njit([_I64(c, c, _I64, _I64) for c in _COUNTS], **_OPTS)
def values_ok(num_sampled, num_rejected, max_ns, max_nr):
    """0 when every num_sampled lies in [0, max_ns] and every num_rejected
    in [0, max_nr] (ppsync.core.rules.checks.value_bounds), else BAD."""
    for i in range(num_sampled.shape[0]):
        ns = np.int64(num_sampled[i])
        nr = np.int64(num_rejected[i])
        if ns < 0 or ns > max_ns or nr < 0 or nr > max_nr:
            return BAD
    return 0


@nb.njit([_I64(_I64[:], _I64[:, :], c, c, d, _B1, _I64[:, :], _COLS, _I64[:])
          for c in _COUNTS for d in _DRAFTS], **_OPTS)
def pack(buf, tokens, num_sampled, num_rejected, drafts, has_drafts, facts, cols, frame_w):
    """Write one step's rows into ``buf``, whose header words (all but the
    checksum) are written already: each row's tokens (-1 beyond w), counts,
    drafts (-1 without), facts (``facts`` [2, n]: slot_need, computed), at
    the columns ``cols`` (column_words; spare columns are the caller's to
    zero); then the checksum over the used prefix, into its word. Returns
    the checksum."""
    tok, L, ns_at, nr_at, dr_at, K, sn_at, nc_at, W = cols
    n, w = tokens.shape[0], tokens.shape[1]
    for i in range(n):
        r = _H + i * W
        for j in range(w):
            buf[r + tok + j] = tokens[i, j]
        for j in range(w, L):
            buf[r + tok + j] = -1
        buf[r + ns_at] = num_sampled[i]
        buf[r + nr_at] = num_rejected[i]
        for j in range(K):
            buf[r + dr_at + j] = drafts[i, j] if has_drafts else -1
        buf[r + sn_at] = facts[0, i]
        buf[r + nc_at] = facts[1, i]
    csum = _checksum(buf, _H + n * W, frame_w)
    buf[_CSUM] = csum
    return csum


# -- receivers ----------------------------------------------------------------

@nb.njit([_I64(_I64[:], _I64, _I64, _I64, _I64, _I64[:, :], _B1[:], _I64[:], _I64,
               _I64[:, :], _I32[:, :], _I64[:], _I64[:, :], t, _B1, _COLS, _I64[:])
          for t in _DRAFTS], **_OPTS)
def release(buf, magic, seq, w, digest, facts, keep, idx, expect_drafts, tokens_out,
            counts_out, idx_out, drafts_out, table, use_table, cols, frame_w):
    """Check a received frame against this rank's view and read it out.

    This rank's view: the header words it expects (``magic``, ``seq``, n =
    ``facts.shape[1]``, ``w``, K, ``digest``) and its row facts ``facts``
    [2, n]; ``expect_drafts``: -1 (take the frame's word), 0 or 1; the
    columns ``cols`` (column_words). Fills
    ``tokens_out`` [n, w], ``counts_out`` [2, n] (num_sampled,
    num_rejected), ``idx_out`` [n] (-1 where not ``keep``), ``drafts_out``
    [n, K] when the frame has drafts, and with ``use_table`` scatters the
    kept rows' drafts into ``table``. Returns the header's flags, BAD (the
    frame disagrees) or DRAFTS_DIFFER; on either nothing was written."""
    tok, _, ns_at, nr_at, dr_at, K, sn_at, nc_at, W = cols
    n = facts.shape[1]
    if buf[0] != magic or buf[1] != seq or buf[2] != n or buf[3] != w or buf[4] != K:
        return BAD
    if _checksum(buf, _H + n * W, frame_w) != buf[_CSUM]:
        return BAD
    for i in range(n):
        r = _H + i * W
        if buf[r + sn_at] != facts[0, i] or buf[r + nc_at] != facts[1, i]:
            return BAD
    if buf[_DIGEST] != digest:
        return BAD
    flags = buf[_FLAGS]
    has_drafts = (flags & _HAS_DRAFTS) != 0
    if expect_drafts >= 0 and (expect_drafts == 1) != has_drafts:
        return DRAFTS_DIFFER
    for i in range(n):
        r = _H + i * W
        for j in range(w):
            tokens_out[i, j] = buf[r + tok + j]
        counts_out[0, i] = buf[r + ns_at]
        counts_out[1, i] = buf[r + nr_at]
        idx_out[i] = idx[i] if keep[i] else -1
        if has_drafts:
            for j in range(K):
                drafts_out[i, j] = buf[r + dr_at + j]
            if use_table and keep[i]:
                for j in range(K):
                    table[idx[i], j] = buf[r + dr_at + j]
    return flags


# -- warm-up ------------------------------------------------------------------

_warm = False


def warm() -> None:
    """Call every kernel once per signature on one-row arrays (results
    unused), so a dispatcher's first-call setup (~5 ms for the first numba
    call in a process, 0.05-0.2 ms for each kernel after) happens when a
    token path is built, not in its first step. Once per process."""
    global _warm
    if _warm:
        return
    i64 = np.int64
    one_row = row_columns(1, 1)  # one row of L = 1, K = 1
    cols = column_words(one_row)
    words = _H + one_row.row_width
    frame_w = np.ones(words, i64)
    for dt in (i64, np.int32):
        one = np.ones(1, dt)
        batch_facts(np.zeros(1, dt), one, one, one, 1, np.empty((3, 1), i64),
                    np.empty(1, np.bool_), np.ones(2, i64), np.zeros(3, i64))
        values_ok(one, one, 1, 1)
        for ddt in (i64, np.int32):
            pack(np.zeros(words, i64), np.zeros((1, 1), i64), one, one,
                 np.zeros((1, 1), ddt), True, np.zeros((2, 1), i64), cols, frame_w)
        # a zeroed frame: the header check answers BAD at once
        release(np.zeros(words, i64), 1, 0, 1, 0, np.zeros((2, 1), i64),
                np.ones(1, np.bool_), np.zeros(1, i64), -1, np.empty((1, 1), i64),
                np.empty((2, 1), np.int32), np.empty(1, i64), np.empty((1, 1), i64),
                np.zeros((1, 1), dt), False, cols, frame_w)
    _warm = True
