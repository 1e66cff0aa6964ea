"""Each vLLM release's PPHandler interface driven through the call sequence
of that release's model runner, on real gloo ranks (what was read from
each release's ``vllm/v1/worker/{gpu,cpu}/model_runner.py`` and
``pp_utils.py``; facts only):

- 0.23-0.29 (interfaces "0.23", "0.25"): ``get_prev_sampled_outputs()``,
  frees, then ``receive(input_batch)`` / ``broadcast(...)``; no drafts travel
  even with K > 0; ``max_seq_len_np`` set on every step;
- 0.30: ``get_prev_sampled_outputs(req_states.draft_tokens)``,
  ``broadcast_drafts(req_states.draft_tokens, input_batch)`` after every
  sampled step with K > 0; ``max_seq_len_np`` never set;
- 0.34's standalone CPU runner ("0.34-cpu"): ``PPHandler(max_num_reqs,
  device)``, K = 0, ``max_seq_len_np`` only when the batch holds a prefill.

Steps with an empty schedule stop after ``get_prev_sampled_outputs``.
Every released row is checked exactly against what the last rank sent,
and the kept rows against the release's own need rule (written out here
from vLLM's ``compute_need_sampled_mask``), which is also checked row by
row where the releases differ. (0.31-0.34 GPU: test_vllm_engine_calls.)
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Literal

import numpy as np
import pytest
import torch
from twin_mode import CARRIED_ENV, check_engine_stream

from ppsync.compat.vllm import PPHandler, PPHandler034Cpu, SampledOutputs
from ppsync.errors import ProtocolError
from ppsync.harness.checker import Checker
from ppsync.harness.launcher import RankEnv, spawn_ranks
from ppsync.harness.synthetic_workload import ScheduledStep, Workload, WorkloadConfig

CPU = torch.device("cpu")
MAX_NUM_REQS = 8
WAIT_S = 10.0


@dataclass(frozen=True, slots=True)
class Batch:
    """vLLM's input batch as the handlers read it, with vLLM's dtypes."""

    num_reqs: int
    idx_mapping: torch.Tensor  # [num_reqs] int64
    idx_mapping_np: np.ndarray  # [num_reqs] np.intp
    num_computed_tokens_np: np.ndarray  # [num_reqs] int32
    num_scheduled_tokens: np.ndarray  # [num_reqs] int32
    prefill_len_np: np.ndarray  # [num_reqs] int32
    is_prefilling_np: np.ndarray  # [num_reqs] bool
    max_seq_len_np: np.ndarray | None  # [num_reqs] int32
    num_draft_tokens: int = 0


def release_batch(interface: str, step: ScheduledStep, K: int) -> Batch:
    """Step's batch as that release's model runner builds it."""
    v = step.view
    in_prefill = v.num_computed_tokens_np < v.prefill_len_np
    assert v.max_seq_len_np is not None
    cap = v.max_seq_len_np.astype(np.int32)
    max_seq = {"0.23": cap, "0.25": cap, "0.30": None}.get(
        interface, cap if in_prefill.any() else None)
    return Batch(
        num_reqs=v.num_reqs, idx_mapping=torch.from_numpy(v.idx_mapping_np),
        idx_mapping_np=v.idx_mapping_np.astype(np.intp),
        num_computed_tokens_np=v.num_computed_tokens_np.astype(np.int32),
        num_scheduled_tokens=v.num_scheduled_tokens_np.astype(np.int32),
        prefill_len_np=v.prefill_len_np.astype(np.int32), is_prefilling_np=in_prefill,
        max_seq_len_np=max_seq, num_draft_tokens=K * int((~in_prefill).sum()))


def release_need(interface: str, b: Batch) -> np.ndarray:
    """[num_reqs] bool: vLLM's compute_need_sampled_mask of that release."""
    c = b.num_computed_tokens_np.astype(np.int64)
    p = b.prefill_len_np.astype(np.int64)
    produces: np.ndarray = c + b.num_scheduled_tokens >= p
    if interface in ("0.23", "0.25"):  # 0.23-0.29: decode rows capped too
        assert b.max_seq_len_np is not None
        return produces & (np.maximum(c, p) + 1 < b.max_seq_len_np)
    if interface == "0.30" or b.max_seq_len_np is None:
        return produces
    return produces & ~(b.is_prefilling_np & (p + 1 >= b.max_seq_len_np))


@dataclass(frozen=True, slots=True)
class Case:
    interface: str
    K: int
    seed: int
    steps: int = 60
    empty_every: int = 5
    emulate: Literal["nccl", "xccl"] | None = None  # the CPU twin (device codec)
    carrier: Literal["host", "device"] = "device"  # with emulate: the twin carries, or the host

    @property
    def table(self) -> bool:
        """The receiver passes vLLM's draft table (0.30-0.32)."""
        return self.interface == "0.30"


RETURNED_DTYPES = {
    interface: {"sampled_tokens": torch.int64, "num_sampled": torch.int32,
                "num_rejected": torch.int32,
                # 0.23-0.29 build it from an np.int32 array; later releases: int64
                "idx_mapping": torch.int32 if interface in ("0.23", "0.25") else torch.int64}
    for interface in ("0.23", "0.25", "0.30", "0.34-cpu")
}
"""What each release's own handler returns from get_prev_sampled_outputs."""


@dataclass(slots=True)
class Seen:
    rows_kept: int = 0
    rows_freed: int = 0
    rows_reused: int = 0
    rows_release_rule: int = 0  # kept or dropped where the workload's own rule differs
    empty_steps: int = 0
    with_drafts: int = 0


def check(case: Case, checker: Checker, now: int, out: SampledOutputs | None,
          table: torch.Tensor, before: torch.Tensor, seen: Seen) -> None:
    rec = checker.workload.history.get(now - 2)
    if rec is None:
        assert out is None and torch.equal(table, before)
        return
    need = release_need(case.interface, release_batch(case.interface, rec, case.K))
    seen.rows_release_rule += int((need != rec.need_np).sum())
    expected = checker.expected_rows(dataclasses.replace(rec, need_np=need), now)
    if not expected.any():
        assert out is None, f"step {now}: released {out} where nothing was expected"
        assert torch.equal(table, before)
        return
    assert out is not None, f"step {now}: nothing released for step {rec.step}"
    assert tuple(out) == ("sampled_tokens", "num_sampled", "num_rejected", "idx_mapping")
    dtypes = {k: v.dtype for k, v in out.items() if isinstance(v, torch.Tensor)}
    assert dtypes == RETURNED_DTYPES[case.interface], (case.interface, dtypes)
    L = case.K + 1
    assert torch.equal(out["sampled_tokens"], torch.from_numpy(rec.tokens_np[:, :L]))
    assert torch.equal(out["num_sampled"], torch.from_numpy(rec.num_sampled_np))
    assert torch.equal(out["num_rejected"], torch.from_numpy(rec.num_rejected_np))
    idx = out["idx_mapping"].numpy()
    kept = idx != -1
    assert np.array_equal(kept, expected), f"step {rec.step}: kept {kept}, expected {expected}"
    assert np.array_equal(idx[kept], rec.view.idx_mapping_np[kept])
    seen.rows_kept += int(kept.sum())
    freed = need & ~expected
    seen.rows_freed += int(freed.sum())
    live = checker.workload.live
    seen.rows_reused += sum(
        1 for row in np.flatnonzero(freed)
        if (r := live.get(int(rec.view.idx_mapping_np[row]))) is not None
        and r.req_id != int(rec.req_ids_np[row]))
    want = before.clone()
    if case.table and case.K:
        assert rec.drafts_np is not None
        want[idx[kept]] = torch.from_numpy(rec.drafts_np[kept])
        seen.with_drafts += int(kept.sum())
    assert torch.equal(table, want), f"step {rec.step}: draft table differs"


def engine_rank(case: Case, env: RankEnv) -> Seen:
    """One rank of the release's model runner, as it calls the handler."""
    K, last = case.K, env.rank == 1
    wl = Workload(WorkloadConfig(max_num_reqs=MAX_NUM_REQS, num_speculative_steps=K,
                                 ring_depth=2, seed=case.seed, steps=case.steps,
                                 abort_p=0.05, preempt_p=0.02))
    checker = Checker(wl)
    table = torch.full((MAX_NUM_REQS, K), -7, dtype=torch.int64)  # req_states.draft_tokens
    seen = Seen()
    # the twin through the handler's own argument
    if case.interface == "0.34-cpu":
        h: PPHandler = PPHandler034Cpu(MAX_NUM_REQS, CPU, timeout_s=WAIT_S, emulate=case.emulate,
                                       carrier=case.carrier)
    else:
        h = PPHandler(MAX_NUM_REQS, K, CPU, timeout_s=WAIT_S, interface=case.interface,
                      emulate=case.emulate, carrier=case.carrier)
    assert h.token_path.completion.stream_ordered == (
        case.emulate is not None and case.carrier == "device")
    with h:
        for t in range(case.steps + 2):
            before = table.clone()
            out = h.get_prev_sampled_outputs(table) if case.table else \
                h.get_prev_sampled_outputs()
            if last:
                assert out is None
            else:
                check(case, checker, t, out, table, before, seen)
            for slot in wl.begin_step(t):
                h.on_req_idx_freed(slot)
            if t % case.empty_every == 2:  # vLLM skips forward and sample_tokens
                seen.empty_steps += 1
                continue
            step = wl.schedule(t)
            batch = release_batch(case.interface, step, K)
            need = release_need(case.interface, batch)
            if not last:
                every = h.receive(batch)
                assert every == bool(step.num_reqs and need.all()), f"step {t}"
                continue
            h.broadcast(torch.from_numpy(step.tokens_np), torch.from_numpy(step.num_sampled_np),
                        torch.from_numpy(step.num_rejected_np), batch)
            if K and case.table:
                assert step.drafts_np is not None
                full = torch.full((MAX_NUM_REQS, K), -50, dtype=torch.int64)
                full[batch.idx_mapping] = torch.from_numpy(step.drafts_np)
                h.broadcast_drafts(full, batch)
            elif K:  # 0.23-0.29 have no broadcast_drafts
                with pytest.raises(ProtocolError, match=r"broadcast_drafts\(\) is not in vLLM "
                                                        rf"{case.interface}'s PPHandler"):
                    h.broadcast_drafts(torch.zeros(step.num_reqs, K, dtype=torch.int64))
    check_engine_stream("gloo" if not case.emulate else
                        "carried" if case.carrier == "host" else "twin")
    return seen


CASES = [
    Case("0.23", K=0, seed=10), Case("0.23", K=2, seed=11), Case("0.25", K=1, seed=12),
    Case("0.30", K=0, seed=13), Case("0.30", K=2, seed=19), Case("0.34-cpu", K=0, seed=15),
    # on the twin of NCCL and XCCL, as the plugin's PPSYNC_EMULATE builds them
    Case("0.23", K=2, seed=11, emulate="nccl"), Case("0.25", K=1, seed=12, emulate="xccl"),
    Case("0.30", K=2, seed=19, emulate="nccl"), Case("0.34-cpu", K=0, seed=15, emulate="xccl"),
    # the host carrier (the default on a device) on the twin of a CUDA / XPU device
    Case("0.25", K=1, seed=12, emulate="xccl", carrier="host"),
    Case("0.34-cpu", K=0, seed=15, emulate="nccl", carrier="host"),
]


@pytest.mark.parametrize("case", CASES, ids=repr)
def test_each_releases_call_sequence_delivers_every_row_exactly(case: Case) -> None:
    receiver, _ = spawn_ranks(functools.partial(engine_rank, case), 2, timeout_s=60.0,
                              env=CARRIED_ENV if case.carrier == "host" else None)
    assert receiver.rows_kept > 0 and receiver.rows_freed > 0 and receiver.empty_steps > 0
    assert receiver.rows_reused > 0  # a freed slot taken by another request, row excluded
    if case.table and case.K:
        assert receiver.with_drafts > 0
    if case.interface == "0.30":  # final prefill chunks at the cap: 0.30 keeps them
        assert receiver.rows_release_rule > 0


# -- the need rule, row by row, where the releases differ ----------------------------

# rows: decode; decode at the cap; final prefill chunk at the cap; non-final prefill chunk
RULE_ROWS = Batch(
    num_reqs=4, idx_mapping=torch.tensor([5, 1, 3, 0]),
    idx_mapping_np=np.array([5, 1, 3, 0], np.intp),
    num_computed_tokens_np=np.array([9, 9, 0, 0], np.int32),
    num_scheduled_tokens=np.array([1, 1, 5, 4], np.int32),
    prefill_len_np=np.array([5, 5, 5, 8], np.int32),
    is_prefilling_np=np.array([False, False, True, True]),
    max_seq_len_np=np.array([100, 10, 6, 100], np.int32),
)
KEPT = {  # rows kept by each interface's need rule (vLLM's, release by release)
    "0.23": [5, -1, -1, -1], "0.25": [5, -1, -1, -1], "0.30": [5, 1, 3, -1],
    "0.32": [5, 1, -1, -1], "0.33": [5, 1, -1, -1], "0.34-cpu": [5, 1, -1, -1],
}


def rule_rank(env: RankEnv) -> dict[str, list[int]]:
    """One step of RULE_ROWS per interface (D = 1); the receiver returns the
    idx_mapping each released."""
    got: dict[str, list[int]] = {}
    for interface in KEPT:
        if interface == "0.34-cpu":
            h: PPHandler = PPHandler034Cpu(MAX_NUM_REQS, CPU, ring_depth=1, timeout_s=WAIT_S)
        else:
            h = PPHandler(MAX_NUM_REQS, 0, CPU, ring_depth=1, timeout_s=WAIT_S,
                          interface=interface)
        table = torch.zeros(MAX_NUM_REQS, 0, dtype=torch.int64)
        with h:
            for t in range(2):
                out = h.get_prev_sampled_outputs(table) if interface in ("0.30", "0.32") \
                    else h.get_prev_sampled_outputs()
                if out is not None:
                    assert torch.equal(out["sampled_tokens"], torch.tensor([[7], [8], [9], [-1]]))
                    got[interface] = out["idx_mapping"].tolist()
                if t == 1:
                    break
                if h.is_last_rank:
                    h.broadcast(torch.tensor([[7], [8], [9], [-1]]),
                                torch.tensor([1, 1, 1, 0], dtype=torch.int32),
                                torch.zeros(4, dtype=torch.int32), RULE_ROWS)
                elif interface == "0.33":
                    assert h.receive(RULE_ROWS, False) is False
                else:
                    assert h.receive(RULE_ROWS) is False
    return got


def test_each_release_keeps_the_rows_its_own_need_rule_keeps() -> None:
    receiver, last = spawn_ranks(rule_rank, 2, timeout_s=60.0)
    assert receiver == KEPT
    assert last == {}
    for interface, kept in KEPT.items():  # the written-out rules say the same
        need = release_need(interface, RULE_ROWS)
        assert [s if n else -1 for s, n in zip(RULE_ROWS.idx_mapping_np.tolist(), need,
                                                 strict=True)] == kept


def test_023_needs_max_seq_len() -> None:
    spawn_ranks(_no_cap_rank, 2, timeout_s=60.0)


def _no_cap_rank(env: RankEnv) -> None:
    from ppsync.errors import BatchError

    with PPHandler(MAX_NUM_REQS, 0, CPU, timeout_s=WAIT_S, interface="0.25") as h:
        h.get_prev_sampled_outputs()
        bad = dataclasses.replace(RULE_ROWS, max_seq_len_np=None)
        with pytest.raises(BatchError, match=r"input_batch.max_seq_len_np is None, but vLLM "
                                             r"0.23-0.29's need rule reads it"):
            if h.is_last_rank:
                h.broadcast(torch.ones(4, 1, dtype=torch.int64),
                            torch.ones(4, dtype=torch.int32), torch.zeros(4, dtype=torch.int32),
                            bad)
            else:
                h.receive(bad)
