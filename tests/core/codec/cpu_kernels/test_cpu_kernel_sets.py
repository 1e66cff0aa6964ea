"""The CPU kernel sets as one contract, in one process: the numba kernels
give the numpy reference's facts, frames (word for word), releases, draft
tables and errors for the same inputs, valid or not; and they serve valid
inputs themselves (no call handed to the reference)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ppsync.core import SampledStep
from ppsync.core.codec.cpu_kernels import NumpyKernels, numba_error
from ppsync.core.codec.steps import PendingStep
from ppsync.core.frame.layout import FrameView
from ppsync.core.frame.numpy_frames import NumpyFrames
from ppsync.core.rules import BatchView
from ppsync.errors import PPSyncError
from ppsync.schemas.config import SyncConfig

pytestmark = pytest.mark.skipif(numba_error() is not None,
                                reason=f"numba cannot be loaded: {numba_error()}")

R = 12  # max_num_reqs
DTYPES = (np.int64, np.int32)


def _sets(k: int, wire: str) -> tuple[NumpyKernels, NumpyKernels]:
    from ppsync.core.codec.cpu_kernels.numba_set import NumbaKernels

    frames = NumpyFrames(SyncConfig.build(pp_size=2, max_num_reqs=R, num_speculative_steps=k,
                                         wire=wire))
    return NumpyKernels(frames), NumbaKernels(frames)


def _outcome(call: Any, *args: Any, **kwargs: Any) -> tuple[str, object]:
    try:
        return "ok", call(*args, **kwargs)
    except PPSyncError as e:
        return type(e).__name__, str(e)


@st.composite
def steps(draw: st.DrawFn) -> dict[str, Any]:
    """One step's inputs on both roles, sometimes with one bad value."""
    k = draw(st.integers(0, 3))
    L = k + 1
    n = draw(st.integers(0, R))
    dt = draw(st.sampled_from(DTYPES))
    idx = np.array(draw(st.permutations(range(R)))[:n], dtype=dt)
    computed = np.array(draw(st.lists(st.integers(0, 60), min_size=n, max_size=n)), dtype=dt)
    scheduled = np.array(draw(st.lists(st.integers(0, 4), min_size=n, max_size=n)), dtype=dt)
    prefill = computed + np.array(draw(st.lists(st.integers(-3, 3), min_size=n, max_size=n)),
                                  dtype=dt)
    prefill = np.maximum(prefill, 0).astype(dt)
    width = draw(st.none() | st.integers(1, L))
    w = L if width is None else draw(st.integers(1, width))
    max_nr = k if width is None else min(k, width - 1)
    ns = np.array(draw(st.lists(st.integers(0, w), min_size=n, max_size=n)), dtype=dt)
    nr = np.array(draw(st.lists(st.integers(0, max_nr), min_size=n, max_size=n)), dtype=dt)
    bad = draw(st.sampled_from(["none"] * 6 + ["idx_range", "idx_twice", "count", "ns",
                                               "nr", "uint", "mixed"]))
    if n:
        i = draw(st.integers(0, n - 1))
        if bad == "idx_range":
            idx[i] = draw(st.sampled_from([-1, R, R + 5]))
        elif bad == "idx_twice" and n > 1:
            idx[i] = idx[(i + 1) % n]
        elif bad == "count":
            computed[i] = -draw(st.integers(1, 5))
        elif bad == "ns":
            ns[i] = draw(st.sampled_from([-1, w + 1]))
        elif bad == "nr":
            nr[i] = draw(st.sampled_from([-1, max_nr + 1]))
    if bad == "uint":
        idx = idx.astype(np.uint8)
    elif bad == "mixed":
        computed = computed.astype(np.int64 if dt == np.int32 else np.int32)
    tokens = np.array(draw(st.lists(st.integers(-(1 << 62), 1 << 62), min_size=n * w,
                                    max_size=n * w)), dtype=np.int64).reshape(n, w)
    drafts = (np.array(draw(st.lists(st.integers(0, (1 << 31) - 1), min_size=n * k,
                                     max_size=n * k)), dtype=draw(st.sampled_from(DTYPES)))
              .reshape(n, k) if k and draw(st.booleans()) else None)
    view = BatchView(num_reqs=n, idx_mapping_np=idx, num_computed_tokens_np=computed,
                     num_scheduled_tokens_np=scheduled, prefill_len_np=prefill)
    return {"k": k, "view": view, "width": width, "tokens": tokens, "ns": ns, "nr": nr,
            "drafts": drafts, "bad": bad, "wire": draw(st.sampled_from(["fixed", "exact"])),
            "seq": draw(st.integers(0, 1 << 40)), "junk": draw(st.integers(-9, 9)),
            "receive": draw(st.sampled_from(["same", "same", "seq", "word", "digest",
                                             "facts", "expect", "keep"])),
            "table": draw(st.sampled_from([None, np.int64, np.int32])),
            "seed": draw(st.integers(0, 1 << 30))}


def _release_fields(out: Any) -> tuple[object, ...]:
    return (out.seq, *((None if t is None else (str(t.dtype), t.numpy().tolist()))
                       for t in (out.sampled_tokens, out.num_sampled, out.num_rejected,
                                 out.idx_mapping, out.draft_tokens)), out.kept_np.tolist())


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps())
def test_numba_kernels_give_the_references_facts_frames_releases_and_errors(
        s: dict[str, Any]) -> None:
    ref, fast = _sets(s["k"], s["wire"])
    view = s["view"]
    # both roles: the batch facts, or the same error
    r_facts, f_facts = _outcome(ref.facts, view), _outcome(fast.facts, view)
    if r_facts[0] != "ok" or f_facts[0] != "ok":
        assert f_facts == r_facts
        return
    rf, ff = r_facts[1], f_facts[1]
    assert (ff.block.tolist(), ff.need.tolist(), ff.needed) == (  # type: ignore[attr-defined]
        rf.block.tolist(), rf.need.tolist(), rf.needed)  # type: ignore[attr-defined]
    if rf.needed:  # type: ignore[attr-defined]
        assert ff.digest == rf.digest  # type: ignore[attr-defined]
    # the last rank: the sampler outputs' checks
    n = view.num_reqs
    sampled = SampledStep(torch.from_numpy(s["tokens"]), torch.from_numpy(s["ns"]),
                          torch.from_numpy(s["nr"]), None, s["width"])
    r_out = _outcome(ref.sampled, sampled, num_reqs=n)
    f_out = _outcome(fast.sampled, sampled, num_reqs=n)
    if r_out[0] != "ok" or f_out[0] != "ok":
        assert f_out == r_out
        return
    if s["bad"] == "none":
        assert fast.fallbacks == 0  # type: ignore[attr-defined]
    # the frame, word for word (the words past the used prefix as they were)
    facts = rf  # the same as ff
    frame = FrameView(s["seq"], n, facts.digest, facts.slot_need, facts.computed,  # type: ignore[attr-defined]
                      s["width"], facts.row_facts)  # type: ignore[attr-defined]
    words = ref.frames.words(n)
    bufs = [np.full(words, s["junk"], dtype=np.int64) for _ in range(2)]
    rows = SampledStep[np.ndarray](s["tokens"], s["ns"], s["nr"], s["drafts"])
    r_pack = ref.pack(bufs[0], frame, rows)
    f_pack = fast.pack(bufs[1], frame, rows)
    assert f_pack == r_pack
    assert bufs[1].tolist() == bufs[0].tolist()
    # a receiver: the release, or the same error, from the same frame
    _compare_release(ref, fast, s, facts, frame, torch.from_numpy(bufs[0]))
    if s["bad"] == "none" and s["receive"] in ("same", "keep"):
        assert fast.fallbacks == 0  # type: ignore[attr-defined]


def _compare_release(ref: NumpyKernels, fast: NumpyKernels, s: dict[str, Any], facts: Any,
                     frame: FrameView, buf: torch.Tensor) -> None:
    rng = np.random.default_rng(s["seed"])
    n, how = frame.num_reqs, s["receive"]
    mine = FrameView(frame.seq + (how == "seq"), n, frame.idx_digest + (how == "digest"),
                     frame.slot_need_np, frame.computed_np, frame.sample_width, frame.facts_np)
    if how == "facts" and n:
        other = facts.row_facts.copy()
        other[rng.integers(0, 2), rng.integers(0, n)] += 2
        mine.facts_np, mine.slot_need_np, mine.computed_np = other, other[0], other[1]
    if how == "word":
        used = ref.frames.used(n)
        buf[int(rng.integers(0, used))] += 1
    keep = facts.need.copy()
    if how == "keep" and n:
        keep &= rng.random(n) < 0.5
    kept = int(np.count_nonzero(keep))
    if kept == 0:
        return  # the path releases nothing then
    has = s["drafts"] is not None and s["k"] > 0
    expect = None if how != "expect" else (not has)
    tables = [None if s["table"] is None or not s["k"] else
              torch.full((R, s["k"]), -7, dtype=torch.int64 if s["table"] == np.int64
                         else torch.int32) for _ in range(2)]
    got = []
    for kernels, table in zip((ref, fast), tables, strict=True):
        head = PendingStep(mine, facts.need, facts.needed, facts.idx.copy(), 0, buf.clone(),
                           None, expect)  # type: ignore[arg-type]
        out = _outcome(kernels.release, head, keep, kept, table, 0)
        got.append((out[0], _release_fields(out[1]) if out[0] == "ok" else out[1],
                    None if table is None else table.tolist()))
    assert got[1] == got[0]


def test_numba_kernels_are_warmed_when_built_never_in_a_step() -> None:
    """Building the kernel set calls every kernel once per signature (the
    dispatchers' first-call setup, ~5 ms, then happens at construction):
    a signature the warm-up gets wrong is a TypeError here."""
    from ppsync.core.codec.cpu_kernels import jit

    jit._warm = False
    _sets(1, "exact")
    assert jit._warm
    jit._warm = False
    jit.warm()  # every signature's call, run again: none raises
    assert jit._warm
