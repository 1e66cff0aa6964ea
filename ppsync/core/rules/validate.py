"""The full checks of a batch view, each failure named (field, row, value,
rule), and the integer helpers the one-pass checks (ppsync.core.rules.facts)
share with them.
"""

from __future__ import annotations

import numpy as np

from ppsync.core.rules.view import BatchView
from ppsync.errors import BatchError


def unsigned_max(a: np.ndarray) -> int:
    """max(a), where any negative entry reads as at least 2**63: one reduction
    checks both ends of a range [0, hi) for any hi <= 2**63, whatever the
    integer dtype. (Reading a narrow signed array as unsigned of its own width
    would not do: int8 -1 reads as 255, inside [0, 300).)"""
    if a.dtype.kind == "u":
        return int(a.max())
    if a.dtype.itemsize < 8:
        a = a.astype(np.int64)  # sign-extends: -1 becomes 2**64 - 1 below
    # same byte order, unsigned 64-bit ("<i8" -> "<u8")
    return int(a.view(a.dtype.str.replace("i", "u")).max())


def _max(a: np.ndarray) -> int:
    """max(a) of a non-empty array: ``a[a.argmax()]`` (argmax has numpy's
    leanest reduction path here, cheaper than ``a.max()``; docs/measured.md)."""
    return int(a[a.argmax()])


_UNSIGNED = {np.dtype(f"{o}i{w}"): np.dtype(f"{o}u{w}") for o in "<>" for w in (1, 2, 4, 8)}
"""Signed dtype -> the unsigned dtype of the same width and byte order."""


def out_of_range(a: np.ndarray, hi: int) -> bool:
    """True iff some entry of the integer array ``a`` lies outside [0, hi), in
    one reduction and without a copy where it can: a signed array read as
    unsigned of its own width puts every negative at or above 2**(bits-1), so
    that reading is exact for any hi <= 2**(bits-1); a larger hi widens a
    narrow signed array first (see :func:`unsigned_max`)."""
    if a.size == 0:
        return False
    dt = a.dtype
    if dt.kind == "u":
        return _max(a) >= hi
    unsigned = _UNSIGNED.get(dt)
    if unsigned is not None and hi <= 1 << (8 * dt.itemsize - 1):
        return _max(a.view(unsigned)) >= hi
    return unsigned_max(a) >= hi


COUNT_LIMIT = 1 << 62
"""Token counts must stay below this: sums of two counts must not wrap int64."""


def _count_limit(dtype: np.dtype) -> int:
    """The unsigned reading at which a count of ``dtype`` is out of range:
    2**62, or the sign bit of a narrower signed type."""
    if dtype.kind == "u":
        return COUNT_LIMIT
    return min(COUNT_LIMIT, 1 << (8 * dtype.itemsize - 1))


def _check_array(name: str, a: object, n: int, *, boolean: bool = False) -> None:
    if not isinstance(a, np.ndarray):
        raise BatchError(f"{name} must be a numpy array, got {type(a).__name__}")
    if a.shape != (n,):
        raise BatchError(f"{name}.shape = {a.shape} must be (num_reqs,) = ({n},)")
    kind = a.dtype.kind
    if boolean:
        if kind != "b":
            raise BatchError(f"{name}.dtype = {a.dtype} must be bool")
    elif kind not in "iu":
        raise BatchError(f"{name}.dtype = {a.dtype} must be an integer dtype")


def plain_shapes_ok(view: object, max_num_reqs: int) -> bool:
    """The usual view in one pass of exact type tests: a BatchView with an
    int num_reqs in range, its four arrays numpy integer arrays of shape
    (num_reqs,), no optional arrays. False: let the rules below decide."""
    if type(view) is not BatchView:
        return False
    n = view.num_reqs
    if type(n) is not int or not 0 <= n <= max_num_reqs or (
            view.max_seq_len_np is not None or view.is_prefilling_np is not None):
        return False
    shape = (n,)
    for a in (view.idx_mapping_np, view.num_computed_tokens_np,
              view.num_scheduled_tokens_np, view.prefill_len_np):
        if type(a) is not np.ndarray or a.shape != shape or a.dtype.kind not in "iu":
            return False
    return True


def check_view_shapes(view: BatchView, max_num_reqs: int) -> None:
    """validate_batch's type, dtype and shape rules alone (no value read)."""
    if plain_shapes_ok(view, max_num_reqs):
        return
    if not isinstance(view, BatchView):
        raise BatchError(f"view must be a BatchView, got {type(view).__name__}")
    n = view.num_reqs
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)):
        raise BatchError(f"num_reqs = {n!r} must be an int")
    if not 0 <= n <= max_num_reqs:
        raise BatchError(f"num_reqs = {n} must lie in [0, max_num_reqs = {max_num_reqs}]")
    _check_array("idx_mapping_np", view.idx_mapping_np, n)
    _check_array("num_computed_tokens_np", view.num_computed_tokens_np, n)
    _check_array("num_scheduled_tokens", view.num_scheduled_tokens_np, n)
    _check_array("prefill_len_np", view.prefill_len_np, n)
    if view.max_seq_len_np is not None:
        _check_array("max_seq_len_np", view.max_seq_len_np, n)
    if view.is_prefilling_np is not None:
        _check_array("is_prefilling_np", view.is_prefilling_np, n, boolean=True)


def validate_batch(view: BatchView, max_num_reqs: int) -> None:
    """Check dtypes, shapes and ranges; raise :class:`BatchError` naming the
    first field that breaks a rule. Runs before any collective."""
    check_view_shapes(view, max_num_reqs)
    n = view.num_reqs
    if n == 0:
        return
    idx = view.idx_mapping_np
    if out_of_range(idx, max_num_reqs):  # one pass catches negatives too
        row = int(np.argmax((idx < 0) | (idx >= max_num_reqs)))
        raise BatchError(
            f"idx_mapping[{row}] = {int(idx[row])} outside [0, max_num_reqs = {max_num_reqs})"
        )
    if n > 1:  # in range, so bincount is at most max_num_reqs long (cheaper than np.unique)
        seen = np.bincount(idx, minlength=max_num_reqs)
        if _max(seen) > 1:
            twice = int(np.argmax(seen))
            raise BatchError(f"idx_mapping holds request slot index {twice} twice; rows must "
                             "map to distinct request slots")
    counts = [
        ("num_computed_tokens_np", view.num_computed_tokens_np),
        ("num_scheduled_tokens", view.num_scheduled_tokens_np),
        ("prefill_len_np", view.prefill_len_np),
    ]
    if view.max_seq_len_np is not None:
        counts.append(("max_seq_len_np", view.max_seq_len_np))
    first = counts[0][1]
    if all(a.dtype == first.dtype for _, a in counts):
        # One pass for all: OR-ing keeps any sign bit and any bit >= 62, so the
        # OR is out of range iff some count is (a sign bit reads as >= 2**62).
        merged = np.bitwise_or(first, counts[1][1])
        for _, a in counts[2:]:
            np.bitwise_or(merged, a, out=merged)
        suspect = out_of_range(merged, _count_limit(merged.dtype))
    else:  # mixed dtypes do not OR safely (int64 | uint64 has no common type)
        suspect = any(out_of_range(a, _count_limit(a.dtype)) for _, a in counts)
    if suspect:
        for name, a in counts:
            bad = (a < 0) | (a >= COUNT_LIMIT)
            if bad.any():
                row = int(np.argmax(bad))
                raise BatchError(f"{name}[{row}] = {int(a[row])} outside [0, 2**62)")
