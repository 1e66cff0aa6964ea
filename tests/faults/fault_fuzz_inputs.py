"""Hypothesis strategies of bad values for the synchronous path's inputs.

Each strategy takes a VALID value and yields a :class:`Bad`: that value with
exactly one rule broken (its type, dtype, shape or range), and the name the
error message must carry. The rest of a call stays valid, so the first check
that fails is the one for the broken field.

Strategies draw from small fixed menus (``sampled_from``) and integers, so a
derandomized run yields the same values in every rank process.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Bad:
    """One bad value and what its error must name."""

    field: str  # a substring the error message must contain
    kind: str  # "type", "dtype", "shape", "range", "duplicate", "mismatch", "role", "order"
    label: str  # what was broken, for reports
    value: object  # the bad value (None for role and order errors)

    def describe(self) -> str:
        return f"{self.field}: {self.kind}: {self.label}"


def fingerprint(items: Sequence[object]) -> str:
    """A digest of ``repr`` of every item: equal on two ranks iff their
    schedules are equal (numpy and torch reprs are deterministic)."""
    h = hashlib.sha256()
    for item in items:
        h.update(repr(item).encode())
    return h.hexdigest()


def collect(strategy: st.SearchStrategy[T], max_examples: int) -> list[T]:
    """Run hypothesis over ``strategy`` and keep what it generates, in order.

    Derandomized (the seed comes from this function's code), no database, no
    health checks, no shrinking: two processes get the same list."""
    out: list[T] = []

    @settings(max_examples=max_examples, deadline=None, database=None, derandomize=True,
              phases=[Phase.generate], suppress_health_check=list(HealthCheck),
              print_blob=False)
    @given(strategy)
    def run(value: T) -> None:
        out.append(value)

    run()
    return out


def uniform(options: Sequence[st.SearchStrategy[T]]) -> st.SearchStrategy[T]:
    """One of ``options``, each as likely as the others (``st.one_of`` favours
    the simplest, and nested, it starves deep branches)."""
    return st.sampled_from(list(options)).flatmap(lambda s: s)


# -- ranges -------------------------------------------------------------------

def _below(lo: int) -> list[int]:
    return sorted({lo - 1, lo - 2, -(2**31), -(2**62), -(2**63)})


def _above(hi: int) -> list[int]:
    return sorted({hi, hi + 1, 2**31, 2**62, 2**63 - 1})


def _set(a: np.ndarray, row: int, value: int) -> np.ndarray:
    dtype = np.uint64 if value >= 2**63 else np.int64
    out = a.astype(dtype, copy=True)
    out[row] = value
    return out


# -- numpy arrays of a batch view ------------------------------------------------

NP_BAD_DTYPES = ["float16", "float32", "float64", "bool", "complex64", "object", "str"]


def np_int_array(
    name: str,
    valid: np.ndarray,  # [n] int
    *,
    lo: int | None = None,
    hi: int | None = None,
    optional: bool = False,
    distinct: bool = False,
) -> st.SearchStrategy[Bad]:
    """Bad versions of a [n] integer array field of a batch view. ``lo``/``hi``:
    its valid range [lo, hi) (None: unchecked); ``distinct``: its entries
    must differ; ``optional``: None is a valid value."""
    n = valid.shape[0]
    types: list[tuple[str, object]] = [
        ("list", valid.tolist()), ("tuple", tuple(valid.tolist())),
        ("torch tensor", torch.from_numpy(valid.copy())), ("int", int(valid[0])),
    ]
    if not optional:
        types.append(("None", None))
    options = [
        st.sampled_from(NP_BAD_DTYPES).map(
            lambda d: Bad(name, "dtype", f"dtype {d}", valid.astype(d))),
        st.sampled_from(types).map(lambda tv: Bad(name, "type", tv[0], tv[1])),
        st.integers(0, n + 4).filter(lambda m: m != n).map(
            lambda m: Bad(name, "shape", f"length {m}", np.resize(valid, m))),
        st.sampled_from([(n, 1), (1, n), ()]).map(
            lambda s: Bad(name, "shape", f"shape {s}", valid[: max(1, n)].reshape(s)
                          if s else np.asarray(valid[0]))),
    ]
    rows = st.integers(0, n - 1)
    if lo is not None:
        options.append(st.tuples(rows, st.sampled_from(_below(lo))).map(
            lambda rv: Bad(name, "range", f"[{rv[0]}] = {rv[1]}", _set(valid, *rv))))
    if hi is not None:
        options.append(st.tuples(rows, st.sampled_from([*_above(hi), 2**63, 2**64 - 1])).map(
            lambda rv: Bad(name, "range", f"[{rv[0]}] = {rv[1]}", _set(valid, *rv))))
    if distinct and n > 1:
        def dup(ij: tuple[int, int]) -> Bad:
            out = valid.copy()
            out[ij[0]] = valid[ij[1]]
            return Bad(name, "duplicate", f"[{ij[0]}] = [{ij[1]}]", out)

        options.append(st.tuples(rows, rows).filter(lambda ij: ij[0] != ij[1]).map(dup))
    return uniform(options)


def np_bool_array(name: str, valid: np.ndarray) -> st.SearchStrategy[Bad]:
    """Bad versions of an optional [n] bool array field of a batch view."""
    n = valid.shape[0]
    return uniform([
        st.sampled_from(["int64", "uint8", "int8", "float32"]).map(
            lambda d: Bad(name, "dtype", f"dtype {d}", valid.astype(d))),
        st.sampled_from([("list", valid.tolist()), ("int", 1)]).map(
            lambda tv: Bad(name, "type", tv[0], tv[1])),
        st.integers(0, n + 3).filter(lambda m: m != n).map(
            lambda m: Bad(name, "shape", f"length {m}", np.resize(valid, m))),
    ])


# -- tensors ------------------------------------------------------------------

TORCH_BAD_DTYPES = {
    "float16": torch.float16, "float32": torch.float32, "float64": torch.float64,
    "bool": torch.bool, "int8": torch.int8, "uint8": torch.uint8, "int16": torch.int16,
    "complex64": torch.complex64,
}


def int_tensor(
    name: str,
    valid: torch.Tensor,  # [n] or [n, w] int64
    *,
    lo: int | None = None,
    hi: int | None = None,
    optional: bool = False,
    bad_widths: Sequence[int] = (),
) -> st.SearchStrategy[Bad]:
    """Bad versions of an int tensor argument: 1-D ``[n]`` values in
    [lo, hi] (None: unchecked), or 2-D ``[n, w]`` whose width must not be
    one of ``bad_widths``."""
    n = valid.shape[0]
    types: list[tuple[str, object]] = [
        ("numpy array", valid.numpy().copy()), ("list", valid.tolist()), ("int", 1),
    ]
    if not optional:
        types.append(("None", None))
    if valid.dim() == 2:
        dims = [("1-D", valid.reshape(-1)), ("3-D", valid.unsqueeze(-1)),
                ("0-D", torch.tensor(1))]
    else:
        dims = [("2-D", valid.reshape(-1, 1)), ("0-D", torch.tensor(1))]
    options = [
        st.sampled_from(sorted(TORCH_BAD_DTYPES)).map(
            lambda d: Bad(name, "dtype", f"dtype {d}", valid.to(TORCH_BAD_DTYPES[d]))),
        st.sampled_from(types).map(lambda tv: Bad(name, "type", tv[0], tv[1])),
        st.sampled_from(dims).map(lambda dv: Bad(name, "shape", dv[0], dv[1])),
        st.integers(0, n + 5).filter(lambda m: m != n).map(
            lambda m: Bad(name, "shape", f"{m} rows",
                          torch.zeros((m, *valid.shape[1:]), dtype=torch.int64))),
    ]
    if valid.dim() == 2 and bad_widths:
        options.append(st.sampled_from(list(bad_widths)).map(
            lambda w: Bad(name, "shape", f"width {w}", torch.zeros((n, w), dtype=torch.int64))))
    rows = st.integers(0, n - 1)

    def at(rv: tuple[int, int]) -> Bad:
        out = valid.clone().to(torch.int64)
        out[rv[0]] = rv[1]
        return Bad(name, "range", f"[{rv[0]}] = {rv[1]}", out)

    if lo is not None:
        options.append(st.tuples(rows, st.sampled_from(_below(lo))).map(at))
    if hi is not None:
        options.append(st.tuples(rows, st.sampled_from(_above(hi + 1))).map(at))
    return uniform(options)


# -- scalars --------------------------------------------------------------------

NOT_INTS: list[tuple[str, object]] = [
    ("float 3.0", 3.0), ("float 1.5", 1.5), ("nan", float("nan")), ("bool True", True),
    ("bool False", False), ("None", None), ("str '3'", "3"), ("np.float64", np.float64(3.0)),
    ("0-d array", np.array(3)), ("array", np.array([1, 2])), ("bytes", b"3"),
]


def bad_int(name: str, lo: int, hi: int, *, also: Sequence[int] = ()) -> st.SearchStrategy[Bad]:
    """Bad values of an int argument valid in [lo, hi), plus ``also`` (valid
    ints that break another rule, e.g. a num_reqs that is not the arrays')."""
    below = [lo - 1, -(2**62), -(2**63), -(2**64)]
    above = [hi, hi + 1, 2**62, 2**63, 2**64]
    options = [
        st.sampled_from(below + above).map(lambda v: Bad(name, "range", f"= {v}", v)),
        st.sampled_from(NOT_INTS).map(lambda tv: Bad(name, "type", tv[0], tv[1])),
    ]
    if also:
        options.append(st.sampled_from(list(also)).map(
            lambda v: Bad(name, "mismatch", f"= {v}", v)))
    return uniform(options)


def view_bads(
    n: int, idx: np.ndarray, counts: dict[str, np.ndarray], max_num_reqs: int
) -> dict[str, st.SearchStrategy[Bad]]:
    """Bad values of each batch-view attribute (``BatchView`` names), given a
    valid view of ``n`` rows in request slots ``idx`` whose count arrays are
    ``counts`` (num_computed_tokens_np, num_scheduled_tokens_np, prefill_len_np)."""
    return {
        "num_reqs": bad_int("num_reqs", 0, max_num_reqs + 1,
                            also=sorted({0, 1, n - 1, n + 1, max_num_reqs} - {n})),
        "idx_mapping_np": np_int_array("idx_mapping", idx, lo=0, hi=max_num_reqs,
                                       distinct=True),
        "num_computed_tokens_np": np_int_array("num_computed_tokens_np",
                                               counts["num_computed_tokens_np"], lo=0),
        # the check names it as the vLLM attribute
        "num_scheduled_tokens_np": np_int_array("num_scheduled_tokens",
                                                counts["num_scheduled_tokens_np"], lo=0),
        "prefill_len_np": np_int_array("prefill_len_np", counts["prefill_len_np"], lo=0),
        "max_seq_len_np": np_int_array("max_seq_len_np", np.full(n, 100, dtype=np.int64),
                                       optional=True),
        "is_prefilling_np": np_bool_array("is_prefilling_np", np.zeros(n, dtype=bool)),
    }


def replace_field(obj: T, attr: str, value: object) -> T:
    """``obj`` (a dataclass) with ``attr`` set to ``value``, unchecked."""
    return dataclasses.replace(obj, **{attr: value})  # type: ignore[type-var]

