"""The row's columns have one source (ppsync.core.frame.rows.ROW_COLUMNS):
a column declared there moves every kernel set with it. A 1-wide spare
column inserted before the tokens, the drafts or the facts shifts every
later offset and W; the CPU kernels (numpy, numba) and the device kernels
(torch ops, Triton in its interpreter) then pack the host numpy frame word
for word, every field at its Columns offset and the spare column 0, and
release the step's tokens, counts, idx and drafts as they were sent.

numba compiles its kernels once for every layout (the columns are an
argument: ppsync.core.codec.cpu_kernels.jit.column_words), so the patched layout
runs the very functions the real one does, with its own offsets; Triton's
constexprs are part of its kernels' cache key."""

from __future__ import annotations

from dataclasses import fields

import numpy as np
import pytest
import torch
from test_device_frames import KERNEL_SETS, kernel_set
from test_device_frames import pack as device_pack
from test_device_frames import release as device_release

from ppsync.core import SampledStep
from ppsync.core.codec.cpu_kernels import NumpyKernels, numba_error
from ppsync.core.codec.steps import PendingStep
from ppsync.core.frame import FrameView, slot_need_words
from ppsync.core.frame import rows as rows_module
from ppsync.core.frame.device_frames import DeviceFrames
from ppsync.core.frame.layout import Column, Columns, row_columns
from ppsync.core.frame.numpy_frames import NumpyFrames
from ppsync.schemas.config import SyncConfig

R, K, N = 8, 2, 5  # max_num_reqs, drafts, rows
L = K + 1
W_STEP = 2  # the step's width w < L: two tokens and one -1 per row

HOST_SETS = [
    "numpy",
    pytest.param("numba", marks=pytest.mark.skipif(
        numba_error() is not None, reason=f"numba cannot be loaded: {numba_error()}")),
]


@pytest.fixture
def real_columns() -> Columns:
    """The columns as declared (taken before spare_before patches them)."""
    return row_columns(L, K)


@pytest.fixture(params=["tokens", "drafts", "slot_need"])
def spare_before(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch,
                 real_columns: Columns) -> str:
    """ROW_COLUMNS with a 1-wide "spare" column before the named one."""
    before: str = request.param
    order = list(rows_module.ROW_COLUMNS)
    at = [name for name, _ in order].index(before)
    order.insert(at, ("spare", 1))
    monkeypatch.setattr(rows_module, "ROW_COLUMNS", tuple(order))
    return before


def _config() -> SyncConfig:
    return SyncConfig.build(pp_size=2, max_num_reqs=R, num_speculative_steps=K)


def _step() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(11)
    idx = rng.permutation(R)[:N].astype(np.int64)
    return {
        "idx": idx,
        "need": np.ones(N, dtype=bool),
        "computed": rng.integers(0, 1 << 40, N).astype(np.int64),
        "tokens": rng.integers(1 << 61, 1 << 62, (N, W_STEP)).astype(np.int64),
        "ns": rng.integers(0, W_STEP + 1, N).astype(np.int32),
        "nr": rng.integers(0, W_STEP, N).astype(np.int32),
        "drafts": rng.integers(0, 1 << 40, (N, K)).astype(np.int64),
        "keep": np.arange(N) % 3 != 1,
    }


def _view(frames: NumpyFrames, s: dict[str, np.ndarray]) -> FrameView:
    facts = np.stack([slot_need_words(s["idx"], s["need"]), s["computed"]])
    return FrameView(3, N, frames.facts_digest(facts), facts[0], facts[1], W_STEP, facts)


def _reference(frames: NumpyFrames, s: dict[str, np.ndarray]) -> np.ndarray:
    """The host numpy frame of the step, in a buffer of stale words."""
    buf = np.full(frames.words(N), 7, dtype=np.int64)
    frames.pack(buf, _view(frames, s), s["tokens"], s["ns"], s["nr"], s["drafts"])
    return buf


def _check_follows(frames: NumpyFrames, buf: np.ndarray, s: dict[str, np.ndarray],
                   released: dict[str, np.ndarray], table: np.ndarray) -> None:
    """Every field at its Columns offset, the spare column 0, and the
    release what was sent."""
    rows, cols = frames.rows(buf, N), frames.columns
    assert len(cols.spare) == 1
    tok = cols.tokens.offset
    assert np.array_equal(rows[:, tok : tok + W_STEP], s["tokens"])
    assert (rows[:, tok + W_STEP : cols.tokens.end] == -1).all()
    assert np.array_equal(rows[:, cols.num_sampled.offset], s["ns"])
    assert np.array_equal(rows[:, cols.num_rejected.offset], s["nr"])
    assert np.array_equal(rows[:, cols.drafts.offset : cols.drafts.end], s["drafts"])
    assert np.array_equal(rows[:, cols.slot_need.offset], slot_need_words(s["idx"], s["need"]))
    assert np.array_equal(rows[:, cols.num_computed.offset], s["computed"])
    spare = cols.spare[0]
    assert (rows[:, spare.offset : spare.end] == 0).all()
    assert np.array_equal(released["tokens"], s["tokens"])
    assert np.array_equal(released["counts"], np.stack([s["ns"], s["nr"]]))
    assert np.array_equal(released["idx"], np.where(s["keep"], s["idx"], -1))
    assert np.array_equal(released["drafts"], s["drafts"])
    want = np.full((R, K), -5)
    want[s["idx"][s["keep"]]] = s["drafts"][s["keep"]]
    assert np.array_equal(table, want)


def test_a_declared_column_shifts_every_later_offset(spare_before: str,
                                                    real_columns: Columns) -> None:
    real, patched = real_columns, row_columns(L, K)
    assert patched.row_width == real.row_width + 1
    names = [f.name for f in fields(Columns) if f.type == "Column"]
    later = names[names.index(spare_before):]  # Columns' fields are in the declared order
    for n in names:
        assert getattr(patched, n) == Column(getattr(real, n).offset + (n in later),
                                             getattr(real, n).width), n
    assert patched.spare == (Column(getattr(real, spare_before).offset, 1),)
    assert {"slot_need", "num_computed"} <= set(later)  # every spare here precedes the facts


@pytest.mark.parametrize("kernels", HOST_SETS)
def test_cpu_kernels_follow_the_declared_columns(spare_before: str, kernels: str) -> None:
    frames = NumpyFrames(_config())
    if kernels == "numba":
        from ppsync.core.codec.cpu_kernels.numba_set import NumbaKernels
        ks: NumpyKernels = NumbaKernels(frames)
    else:
        ks = NumpyKernels(frames)
    s = _step()
    view = _view(frames, s)
    buf = torch.full((frames.words(N),), 7, dtype=torch.int64)
    ks.pack(buf.numpy(), view, SampledStep(s["tokens"], s["ns"], s["nr"], s["drafts"]))
    table = torch.full((R, K), -5, dtype=torch.int64)
    head = PendingStep(view, s["need"], N, s["idx"].copy(), 0, buf.clone(), None,  # type: ignore[arg-type]
                       True)
    out = ks.release(head, s["keep"], int(s["keep"].sum()), table, 0)
    assert out.draft_tokens is not None
    assert getattr(ks, "fallbacks", 0) == 0  # numba served every call itself
    assert np.array_equal(buf.numpy(), _reference(frames, s))
    _check_follows(frames, buf.numpy(), s, {
        "tokens": out.sampled_tokens.numpy(),
        "counts": np.stack([out.num_sampled.numpy(), out.num_rejected.numpy()]),
        "idx": out.idx_mapping.numpy(), "drafts": out.draft_tokens.numpy()}, table.numpy())


@pytest.mark.parametrize("kernels", KERNEL_SETS)
def test_device_kernels_follow_the_declared_columns(spare_before: str, kernels: str) -> None:
    dev = DeviceFrames(_config(), torch.device("cpu"))
    ks = kernel_set(kernels, dev)
    s = _step()
    view = _view(dev.layout, s)
    buf, verdict = device_pack(ks, dev, view, dev.layout.flags(True), s["tokens"], s["ns"],
                               s["nr"], s["drafts"])
    assert verdict == 0
    used = dev.layout.used(N)
    assert np.array_equal(buf.numpy()[:used], _reference(dev.layout, s)[:used])
    table = torch.full((R, K), -5, dtype=torch.int64)
    verdict, out = device_release(ks, dev, buf, view, s["keep"], expect=True, table=table)
    assert verdict == 0
    assert out.drafts is not None
    _check_follows(dev.layout, buf.numpy(), s, {
        "tokens": out.tokens.numpy(), "counts": out.counts.numpy(),
        "idx": out.idx_mapping.numpy(), "drafts": out.drafts.numpy()}, table.numpy())



def test_the_sent_record_names_its_columns_as_declared() -> None:
    """SampledStep's fields are the columns the sampler fills, in the order
    and under the names ROW_COLUMNS gives them, then the step's width."""
    declared = [name for name, _ in rows_module.ROW_COLUMNS]
    sent = list(rows_module.SENT_COLUMNS)
    assert [f.name for f in fields(SampledStep)] == [*sent, "sample_width"]
    assert [name for name in declared if name in sent] == sent
