"""The synthetic workload (docs/design.md §6), in one process: deterministic from
its seed, and every step it schedules is a valid, self-consistent batch."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from ppsync.core.rules import validate_batch
from ppsync.core.rules.mask import need_sampled_mask
from ppsync.harness.synthetic_workload import (
    SALT_DRAFT,
    ScheduledStep,
    Workload,
    WorkloadConfig,
    oracle,
)

STEPS = 300


def _cfg(**fields: object) -> WorkloadConfig:
    base: dict[str, object] = {
        "max_num_reqs": 16, "num_speculative_steps": 3, "ring_depth": 2, "seed": 0,
        "steps": STEPS, "abort_p": 0.05, "preempt_p": 0.02, "idle_every": 30,
    }
    base.update(fields)
    return WorkloadConfig(**base)  # type: ignore[arg-type]


def _run(cfg: WorkloadConfig) -> Iterator[tuple[list[int], ScheduledStep]]:
    """Drive the workload as every rank does: begin_step, then schedule."""
    wl = Workload(cfg)
    for t in range(cfg.steps + cfg.ring_depth):
        freed = wl.begin_step(t)
        yield freed, wl.schedule(t)


def _same(a: ScheduledStep, b: ScheduledStep) -> bool:
    arrays = (
        "req_ids_np", "positions_np", "need_np", "tokens_np", "num_sampled_np",
        "num_rejected_np",
    )
    view_arrays = (
        "idx_mapping_np", "num_computed_tokens_np", "num_scheduled_tokens_np", "prefill_len_np",
        "max_seq_len_np", "is_prefilling_np",
    )
    return (
        (a.step, a.width, a.seq, a.num_reqs) == (b.step, b.width, b.seq, b.num_reqs)
        and all(np.array_equal(getattr(a, f), getattr(b, f)) for f in arrays)
        and all(np.array_equal(getattr(a.view, f), getattr(b.view, f)) for f in view_arrays)
        and _same_drafts(a.drafts_np, b.drafts_np)
    )


def _same_drafts(a: np.ndarray | None, b: np.ndarray | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return np.array_equal(a, b)


def test_same_seed_gives_identical_steps() -> None:
    cfg = _cfg(seed=11)
    runs = list(zip(_run(cfg), _run(cfg), strict=True))
    assert len(runs) == STEPS + cfg.ring_depth
    assert any(s.num_reqs for (_, s), _ in runs)
    for (freed_a, a), (freed_b, b) in runs:
        assert freed_a == freed_b
        assert _same(a, b), a.step


def test_different_seeds_differ() -> None:
    a = [s for _, s in _run(_cfg(seed=1))]
    b = [s for _, s in _run(_cfg(seed=2))]
    differing = sum(not _same(x, y) for x, y in zip(a, b, strict=True))
    assert differing > STEPS // 2


CONFIGS = [
    pytest.param(_cfg(num_speculative_steps=0, ring_depth=1, max_num_reqs=8), id="K0-D1-M8"),
    pytest.param(_cfg(num_speculative_steps=3, ring_depth=3, max_num_reqs=64), id="K3-D3-M64"),
    pytest.param(_cfg(num_speculative_steps=2, ring_depth=4, max_num_reqs=8, seed=5),
                 id="K2-D4-M8"),
    pytest.param(_cfg(num_speculative_steps=3, ring_depth=2, use_max_seq_len=False),
                 id="K3-D2-no-cap"),
]


@pytest.mark.parametrize("cfg", CONFIGS)
def test_every_step_is_a_valid_consistent_batch(cfg: WorkloadConfig) -> None:
    K, L, D = cfg.num_speculative_steps, cfg.num_speculative_steps + 1, cfg.ring_depth
    seq = 0
    rows = decode_rows = prefill_rows = 0
    recent: dict[int, set[int]] = {}  # step -> request ids scheduled
    for _, s in _run(cfg):
        n = s.num_reqs
        view = s.view
        validate_batch(view, cfg.max_num_reqs)
        assert (view.max_seq_len_np is not None) == cfg.use_max_seq_len
        # the workload's own rule agrees with the core's
        assert np.array_equal(s.need_np, need_sampled_mask(view)), s.step
        # a frame number for exactly the steps with a transfer, in order
        if s.need_np.any():
            assert s.seq == seq
            seq += 1
        else:
            assert s.seq == -1
        # widths and counts
        assert 1 <= s.width <= L
        assert s.tokens_np.shape == (n, L)
        assert s.num_sampled_np.shape == s.num_rejected_np.shape == (n,)
        assert s.num_sampled_np.dtype == s.num_rejected_np.dtype == np.int32
        assert ((s.num_sampled_np >= 0) & (s.num_sampled_np <= s.width)).all()
        assert ((s.num_rejected_np >= 0) & (s.num_rejected_np <= K)).all()
        assert (s.num_sampled_np[s.need_np] >= 1).all()
        if K == 0:
            assert s.drafts_np is None
            assert not s.num_rejected_np.any()
        else:
            assert s.drafts_np is not None
            assert s.drafts_np.shape == (n, K)
            after = s.positions_np + s.num_sampled_np
            expected = oracle(s.req_ids_np[:, None], after[:, None] + np.arange(K), SALT_DRAFT)
            assert np.array_equal(s.drafts_np, expected.reshape(n, K))
        # tokens: the oracle up to num_sampled, -1 after it
        cols = np.arange(L)
        valid = cols[None, :] < s.num_sampled_np[:, None]
        truth = oracle(s.req_ids_np[:, None], s.positions_np[:, None] + cols[None, :])
        assert np.array_equal(s.tokens_np, np.where(valid, truth, -1).reshape(n, L))
        # decode rows schedule 1 + K tokens; prefill rows do not exceed the prompt
        computed, prefill = view.num_computed_tokens_np, view.prefill_len_np
        decoding = computed >= prefill
        assert (view.num_scheduled_tokens_np[decoding] == 1 + K).all()
        assert (computed + view.num_scheduled_tokens_np <= prefill)[~decoding].all()
        # a request is never in two steps in flight together (its lane's steps)
        ids = set(s.req_ids_np.tolist())
        assert len(ids) == n
        for t in range(s.step - D + 1, s.step):
            assert not ids & recent.get(t, set()), (s.step, t)
        recent[s.step] = ids
        assert all(r % D == s.step % D for r in ids)
        rows += n
        decode_rows += int(decoding.sum())
        prefill_rows += int((~decoding).sum())
    assert seq > 0 and decode_rows > 0 and prefill_rows > 0


def test_freed_slots_were_live_and_drain_steps_are_empty() -> None:
    cfg = _cfg(seed=3)
    wl = Workload(cfg)
    freed_total = 0
    for t in range(cfg.steps + cfg.ring_depth):
        before = set(wl.live)
        freed = wl.begin_step(t)
        assert len(freed) == len(set(freed)), t
        assert set(freed) <= before, t  # only slots in use are freed
        freed_total += len(freed)
        step = wl.schedule(t)
        assert set(step.view.idx_mapping_np.tolist()) <= set(wl.live), t
        if t >= cfg.steps:
            assert step.num_reqs == 0, t
    assert freed_total > 0
