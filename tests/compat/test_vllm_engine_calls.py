"""The vLLM adapter driven through vLLM's own call sequences, on real gloo
ranks, one process per rank, with the synthetic workload's requests.

- vLLM 0.32: ``get_prev_sampled_outputs(req_states.draft_tokens)`` every
  step on every rank, the table ``[max_num_reqs, 0]`` when K = 0;
  ``on_req_idx_freed`` for every freed slot (slots are reused at once);
  ``receive(input_batch)`` / ``broadcast`` + ``broadcast_drafts(table,
  input_batch)``; input batches with vLLM's dtypes (``np.intp`` slots,
  ``np.int32`` counts, ``is_prefilling_np`` always, ``max_seq_len_np`` only
  when the batch holds a prefill); with P = 3, hidden states and an aux
  hidden state pass down the pipe through ``relay_aux_hidden_states``,
  configured from a model object by the stand-in of vLLM's EAGLE3 helper.
- vLLM 0.33: ``get_prev_sampled_outputs()`` with drafts under a fifth key;
  ``receive(input_batch, recv_drafts)``; ``broadcast_drafts(drafts)`` with
  the drafts gathered; the sample width 1 or L per step.
- Both: steps with an empty schedule (``get_prev_sampled_outputs`` only, no
  receive or broadcast, no forward) interleaved.

Every released row is checked exactly against the workload's record of the
step D steps before; a recv_drafts or a sample width (0.33) that disagrees
with the last rank's is a DesyncError on every rank (they share a failure
board), never a hang.
"""

from __future__ import annotations

import functools
import importlib
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np
import pytest
import torch
import torch.distributed as dist
from twin_mode import CARRIED_ENV, check_engine_stream
from vllm_standin import use_standin, write_standin

from ppsync.compat.vllm import PPHandler, SampledOutputs
from ppsync.errors import DesyncError, RankFailed
from ppsync.harness.checker import Checker
from ppsync.harness.launcher import RankEnv, spawn_ranks
from ppsync.harness.synthetic_workload import ScheduledStep, Workload, WorkloadConfig

CPU = torch.device("cpu")
MAX_NUM_REQS = 8
SPAWN_TIMEOUT_S = 60.0
WAIT_S = 10.0
AUX_KEY = "aux_hidden_state_0"
Interface = Literal["0.32", "0.33"]


@dataclass(frozen=True, slots=True)
class VllmInputBatch:
    """vLLM's input batch as the handler reads it, with vLLM's dtypes."""

    num_reqs: int
    idx_mapping: torch.Tensor  # [num_reqs] int64
    idx_mapping_np: np.ndarray  # [num_reqs] np.intp
    num_computed_tokens_np: np.ndarray  # [num_reqs] int32
    num_scheduled_tokens: np.ndarray  # [num_reqs] int32
    prefill_len_np: np.ndarray  # [num_reqs] int32
    is_prefilling_np: np.ndarray  # [num_reqs] bool, always set
    max_seq_len_np: np.ndarray | None  # [num_reqs] int32, only when a row is in prefill
    num_draft_tokens: int  # draft tokens the step verifies (0.33 reads it)


def vllm_batch(step: ScheduledStep, K: int) -> VllmInputBatch:
    v = step.view
    in_prefill = v.num_computed_tokens_np < v.prefill_len_np
    max_seq = v.max_seq_len_np
    return VllmInputBatch(
        num_reqs=v.num_reqs,
        idx_mapping=torch.from_numpy(v.idx_mapping_np),
        idx_mapping_np=v.idx_mapping_np.astype(np.intp),
        num_computed_tokens_np=v.num_computed_tokens_np.astype(np.int32),
        num_scheduled_tokens=v.num_scheduled_tokens_np.astype(np.int32),
        prefill_len_np=v.prefill_len_np.astype(np.int32),
        is_prefilling_np=in_prefill,
        max_seq_len_np=max_seq.astype(np.int32) if max_seq is not None and in_prefill.any()
        else None,
        num_draft_tokens=K * int((~in_prefill).sum()),  # decode rows verify K drafts
    )


@dataclass(frozen=True, slots=True)
class Case:
    interface: Interface
    pp_size: int
    K: int
    steps: int = 60
    seed: int = 0
    empty_every: int = 5  # steps t % empty_every == 2 have an empty schedule
    no_drafts_every: int = 0  # steps t % no_drafts_every == 1 propose no drafts
    aux: bool = False  # stages pass hidden states and a relayed aux down the pipe
    emulate: Literal["nccl", "xccl"] | None = None  # the CPU twin (device codec)
    carrier: Literal["host", "device"] = "device"  # with emulate: the twin carries, or the host
    idle_at: int = -1  # after this step (its drafts skipped) every rank idles IDLE_S
    timeout_s: float = WAIT_S
    warmup: int = 0  # synthetic steps first, with the handler disabled (vLLM's warm-up)

    @property
    def L(self) -> int:
        return self.K + 1

    def empty(self, t: int) -> bool:
        return t % self.empty_every == 2

    def proposes(self, t: int) -> bool:
        return self.K > 0 and not (self.no_drafts_every and t % self.no_drafts_every == 1)

    def width(self, step: ScheduledStep) -> int:
        """The step's sample width: L in 0.32; in 0.33, L when it verifies drafts."""
        if self.interface == "0.32":
            return self.L
        return self.L if vllm_batch(step, self.K).num_draft_tokens > 0 else 1


@dataclass(slots=True)
class Seen:
    """What one rank saw, so the parent can tell the run covered each case."""

    rows_kept: int = 0
    rows_freed: int = 0  # needed a sample, but the slot was freed meanwhile
    rows_reused: int = 0  # ... and another request holds the slot by the consume
    rows_with_drafts: int = 0
    rows_without_drafts: int = 0
    empty_steps: int = 0
    widths: set[int] = field(default_factory=set)
    relayed: int = 0


KEYS = ("sampled_tokens", "num_sampled", "num_rejected", "idx_mapping")


def check_release(
    case: Case,
    checker: Checker,
    now: int,
    out: SampledOutputs | None,
    table: torch.Tensor,  # [max_num_reqs, K] after the call (0.32)
    before: torch.Tensor,  # [max_num_reqs, K] before the call
    seen: Seen,
) -> None:
    rec = checker.workload.history.get(now - case.pp_size)
    expected = np.zeros(0, bool) if rec is None else checker.expected_rows(rec, now)
    if rec is None or not expected.any():
        assert out is None, f"step {now}: released {out} where nothing was expected"
        assert torch.equal(table, before)
        return
    assert out is not None, f"step {now}: nothing released for step {rec.step}"
    assert tuple(out) == KEYS + (("draft_tokens",) if case.interface == "0.33" else ())
    values = [out["sampled_tokens"], out["num_sampled"], out["num_rejected"], out["idx_mapping"]]
    assert [v.dtype for v in values] == [torch.int64, torch.int32, torch.int32, torch.int64]
    w = case.width(rec)
    seen.widths.add(w)
    assert torch.equal(out["sampled_tokens"], torch.from_numpy(rec.tokens_np[:, :w]))
    assert torch.equal(out["num_sampled"], torch.from_numpy(rec.num_sampled_np))
    assert torch.equal(out["num_rejected"], torch.from_numpy(rec.num_rejected_np))
    idx = out["idx_mapping"].numpy()
    kept = idx != -1
    assert np.array_equal(kept, expected), f"step {rec.step}: kept {kept}, expected {expected}"
    assert np.array_equal(idx[kept], rec.view.idx_mapping_np[kept])
    seen.rows_kept += int(kept.sum())
    freed = rec.need_np & ~expected
    seen.rows_freed += int(freed.sum())
    live = checker.workload.live  # slot -> request, as of the step before this one
    seen.rows_reused += sum(  # freed rows whose slot another request holds by now
        1 for row in np.flatnonzero(freed)
        if (r := live.get(int(rec.view.idx_mapping_np[row]))) is not None
        and r.req_id != int(rec.req_ids_np[row]))
    with_drafts = case.proposes(rec.step)
    seen.rows_with_drafts += int(kept.sum()) if with_drafts else 0
    seen.rows_without_drafts += 0 if with_drafts else int(kept.sum())
    if case.interface == "0.33":
        drafts = out.get("draft_tokens")
        if with_drafts:
            assert rec.drafts_np is not None and drafts is not None
            assert torch.equal(drafts, torch.from_numpy(rec.drafts_np))
        else:
            assert drafts is None
        assert torch.equal(table, before)  # 0.33 takes no table
        return
    want = before.clone()
    if with_drafts:
        assert rec.drafts_np is not None
        want[idx[kept]] = torch.from_numpy(rec.drafts_np[kept])
    assert torch.equal(table, want), f"step {rec.step}: draft table differs"


def forward(h: PPHandler, env: RankEnv, t: int, seen: Seen) -> None:
    """A stage's forward of step t with vLLM's IntermediateTensors: the first
    stage makes an aux hidden state, the middle ones relay it (keys from the
    model object), the last one reads it."""
    # the stand-in's, on sys.path in this rank
    IntermediateTensors = importlib.import_module("vllm.sequence").IntermediateTensors

    rank, size = env.rank, env.world_size
    step = torch.tensor([t])
    if rank == 0:
        out = IntermediateTensors({"hidden_states": step, AUX_KEY: step * 10})
    else:
        buf = torch.empty(2, dtype=torch.int64)
        dist.recv(buf, src=rank - 1)
        assert buf.tolist() == [t + rank - 1, t * 10], f"step {t}: {buf.tolist()}"
        up = IntermediateTensors({"hidden_states": buf[:1], AUX_KEY: buf[1:]})
        mine = IntermediateTensors({"hidden_states": step + rank}, kv_connector_output=rank)
        out = h.relay_aux_hidden_states(up, mine)
        assert type(out) is IntermediateTensors and out.kv_connector_output == rank
        if rank == size - 1:
            assert out is mine  # the last stage relays nothing
            return
        assert out.tensors[AUX_KEY] is up.tensors[AUX_KEY]
        seen.relayed += 1
    dist.send(torch.cat([out.tensors["hidden_states"], out.tensors[AUX_KEY]]), dst=rank + 1)


def warm_up(h: PPHandler, case: Case, last: bool) -> None:
    """vLLM's warm-up as an open vLLM PR runs it: synthetic steps on every
    rank with the handler disabled around them. Disabled, it issues nothing
    and answers as vLLM's own does; enabled again, the real steps follow."""
    h.set_disabled(True)
    K = case.K
    n = 2
    dummy = VllmInputBatch(
        num_reqs=n, idx_mapping=torch.arange(n), idx_mapping_np=np.arange(n, dtype=np.intp),
        num_computed_tokens_np=np.full(n, 9, np.int32), num_scheduled_tokens=np.ones(n, np.int32),
        prefill_len_np=np.full(n, 4, np.int32), is_prefilling_np=np.zeros(n, bool),
        max_seq_len_np=None, num_draft_tokens=K * n)
    for _ in range(case.warmup):
        assert h.get_prev_sampled_outputs() is None
        if last:
            h.broadcast(torch.zeros(n, K + 1, dtype=torch.int64),
                        torch.ones(n, dtype=torch.int32),
                        torch.zeros(n, dtype=torch.int32), dummy)
            if K:
                h.broadcast_drafts(torch.zeros(n, K, dtype=torch.int64))
        else:
            assert h.receive(dummy, K > 0) is True  # every row needs a sample
    assert h.token_path.seq == 0  # nothing was issued
    h.set_disabled(False)


class Model(torch.nn.Module):
    """vLLM's model as the stand-in EAGLE3 helper reads it."""

    aux_keys = (AUX_KEY,)


def engine_rank(case: Case, standin: Path, env: RankEnv) -> Seen:
    """One rank of vLLM's Model Runner V2, as it calls the handler."""
    use_standin(standin)
    K, last = case.K, env.rank == case.pp_size - 1
    wl = Workload(WorkloadConfig(
        max_num_reqs=MAX_NUM_REQS, num_speculative_steps=K, ring_depth=case.pp_size,
        seed=case.seed, steps=case.steps, abort_p=0.05, preempt_p=0.02,
    ))
    checker = Checker(wl)
    table = torch.full((MAX_NUM_REQS, K), -7, dtype=torch.int64)  # req_states.draft_tokens
    rng = np.random.default_rng(case.seed + 1000)
    seen = Seen()

    def sample_tokens(h: PPHandler, t: int, step: ScheduledStep, batch: VllmInputBatch,
                      drafts: bool) -> None:
        """The last rank's sample_tokens: broadcast, then broadcast_drafts
        when the step proposed drafts; it returns before the next step."""
        w = case.width(step)
        h.broadcast(torch.from_numpy(step.tokens_np[:, :w]),
                    torch.from_numpy(step.num_sampled_np),
                    torch.from_numpy(step.num_rejected_np), batch)
        if case.proposes(t):
            assert step.drafts_np is not None
            if case.interface == "0.32":
                # noise in every slot; the step's drafts at its rows' slots
                full = torch.from_numpy(rng.integers(-99, -10, (MAX_NUM_REQS, K)))
                full[batch.idx_mapping] = torch.from_numpy(step.drafts_np)
                h.broadcast_drafts(full, batch)
            elif drafts:
                h.broadcast_drafts(torch.from_numpy(step.drafts_np))

    with PPHandler(MAX_NUM_REQS, K, CPU, timeout_s=case.timeout_s, interface=case.interface,
                   emulate=case.emulate, carrier=case.carrier) as h:
        assert h.is_last_rank == last
        assert h.token_path.completion.stream_ordered == (
            case.emulate is not None and case.carrier == "device")
        if case.aux:
            h.configure_aux_hidden_state_relay(Model())
        if case.warmup:
            warm_up(h, case, last)
        for t in range(case.steps + case.pp_size):
            before = table.clone()
            if case.interface == "0.32":
                out = h.get_prev_sampled_outputs(table)
            else:
                out = h.get_prev_sampled_outputs()
            if last:
                assert out is None
            else:
                check_release(case, checker, t, out, table, before, seen)
            for slot in wl.begin_step(t):
                h.on_req_idx_freed(slot)
            if case.empty(t):  # vLLM skips forward and sample_tokens
                seen.empty_steps += 1
                continue
            step = wl.schedule(t)
            batch = vllm_batch(step, K)
            if case.aux:
                forward(h, env, t, seen)
            drafts = case.proposes(t) and bool(step.need_np.any())  # 0.33: only after tokens
            if not last:
                if case.interface == "0.32":
                    every = h.receive(batch)
                else:
                    every = h.receive(batch, drafts)
                assert every == bool(step.num_reqs and step.need_np.all()), f"step {t}"
            else:
                sample_tokens(h, t, step, batch, drafts)
            if t == case.idle_at:  # the engine goes idle: no call on any rank
                assert not case.proposes(t) and step.need_np.any(), "the premise"
                time.sleep(3 * case.timeout_s)
                # no receive is left pending on a frame the last rank held
                path = h.token_path
                pending = [p.frame.seq for p in path.ring.pending()
                           if p is not None and not path.completion.ended(p.work)]
                assert pending == [], f"rank {env.rank}: frames {pending} never came"
    check_engine_stream("gloo" if not case.emulate else
                        "carried" if case.carrier == "host" else "twin")
    return seen


CASES = [
    Case("0.32", pp_size=2, K=0),
    Case("0.32", pp_size=3, K=3, seed=1, aux=True),
    Case("0.33", pp_size=2, K=3, no_drafts_every=3, seed=2),
    Case("0.33", pp_size=3, K=2, no_drafts_every=4, seed=3, empty_every=4),
    Case("0.33", pp_size=2, K=0, seed=4),
    # on the twin of NCCL and XCCL, as the plugin's PPSYNC_EMULATE builds them
    Case("0.32", pp_size=3, K=3, seed=1, aux=True, emulate="nccl"),
    Case("0.33", pp_size=2, K=3, no_drafts_every=3, seed=2, emulate="xccl"),
    # a step whose drafts were skipped (vLLM 0.33 on calls no broadcast_drafts
    # then), then the engine idles for 3 x timeout_s: the held frame goes from
    # the last rank's watcher once sample_tokens returned, and the run goes
    # on exactly (before, the receivers' receive stayed pending and the
    # post-based clocks ended the healthy idle server)
    Case("0.33", pp_size=2, K=2, no_drafts_every=3, seed=5, steps=30, idle_at=10,
         timeout_s=2.0),
    Case("0.33", pp_size=2, K=2, no_drafts_every=3, seed=5, steps=30, idle_at=13,
         timeout_s=2.0, emulate="nccl"),
    # warm-up steps with the handler disabled (set_disabled), then real ones
    Case("0.33", pp_size=3, K=2, no_drafts_every=4, seed=3, empty_every=4, warmup=5),
    # the host carrier (the default on a GPU) on the twin of a CUDA device
    Case("0.32", pp_size=3, K=3, seed=1, aux=True, emulate="nccl", carrier="host"),
    Case("0.33", pp_size=2, K=3, no_drafts_every=3, seed=2, emulate="nccl", carrier="host"),
    Case("0.33", pp_size=2, K=2, no_drafts_every=3, seed=5, steps=30, idle_at=10,
         timeout_s=2.0, emulate="nccl", carrier="host"),
]


@pytest.mark.parametrize("case", CASES, ids=repr)
def test_vllm_call_sequences_deliver_every_row_exactly(case: Case, tmp_path: Path) -> None:
    standin = write_standin(tmp_path)
    seen = spawn_ranks(functools.partial(engine_rank, case, standin), case.pp_size,
                       timeout_s=SPAWN_TIMEOUT_S,
                       env=CARRIED_ENV if case.carrier == "host" else None)
    receivers = seen[:-1]
    for s in receivers:
        assert s.rows_kept > 0 and s.rows_freed > 0 and s.empty_steps > 0
        assert s.rows_reused > 0  # slot reuse within D steps, rows still excluded
        if case.K:
            assert s.rows_with_drafts > 0
        if case.no_drafts_every:
            assert s.rows_without_drafts > 0
    if case.interface == "0.33" and case.K:
        assert all(s.widths == {1, case.L} for s in receivers)  # both widths, mixed
    else:  # 0.32: always L; 0.33 without drafts: always 1 (= L)
        assert all(s.widths == {case.L} for s in receivers)
    assert len({(s.rows_kept, s.rows_freed) for s in receivers}) == 1
    if case.aux:
        assert seen[1].relayed > 0 and seen[0].relayed == seen[2].relayed == 0


# -- recv_drafts disagrees with the last rank -----------------------------------------

MISMATCH_AT = 4  # the ring (D = 2) is full by then


def mismatch_rank(case: str, env: RankEnv) -> str:
    """Decode steps on fixed slots; at step MISMATCH_AT the receiver's view
    differs from the last rank's: ``expects``: its recv_drafts is True and
    the last rank sends no drafts; ``does-not``: the opposite; ``width``: its
    batch verifies no drafts (width 1), the last rank's does (width L).
    Returns the DesyncError's message (every rank must raise one)."""
    board = env.failure_board(dist.group.WORLD)  # type: ignore[arg-type]
    h = PPHandler(MAX_NUM_REQS, 2, CPU, timeout_s=WAIT_S, interface="0.33", board=board)
    return drive_mismatch(h, case)


def drive_mismatch(h: PPHandler, case: str) -> str:
    """The steps of :func:`mismatch_rank` on a built 0.33 handler with K = 2."""
    K = h.config.num_speculative_steps
    slots = np.array([3, 5], dtype=np.intp)
    try:
        for t in range(200):  # far more than the run can take once the desync is seen
            h.get_prev_sampled_outputs()
            at = t == MISMATCH_AT
            narrow = at and case == "width" and not h.is_last_rank
            batch = VllmInputBatch(
                num_reqs=2, idx_mapping=torch.from_numpy(slots.astype(np.int64)),
                idx_mapping_np=slots, num_computed_tokens_np=np.full(2, 10 + t, np.int32),
                num_scheduled_tokens=np.full(2, 1 + K, np.int32),
                prefill_len_np=np.full(2, 5, np.int32), is_prefilling_np=np.zeros(2, bool),
                max_seq_len_np=None, num_draft_tokens=0 if narrow else 2 * K,
            )
            if not h.is_last_rank:
                h.receive(batch, not (at and case == "does-not"))
                continue
            h.broadcast(torch.full((2, K + 1), t), torch.full((2,), K + 1, dtype=torch.int32),
                        torch.zeros(2, dtype=torch.int32), batch)
            if not (at and case == "expects"):
                h.broadcast_drafts(torch.full((2, K), 100 + t))
    except DesyncError as e:
        h.close(drain=False)
        return str(e)
    raise AssertionError("no DesyncError after 200 steps")


MISMATCHES = {
    "expects": rf"rank 0: frame seq {MISMATCH_AT}: this rank expects drafts "
               r"\(expect_drafts = True; vLLM's recv_drafts\) but the last rank sent none",
    "does-not": rf"rank 0: frame seq {MISMATCH_AT}: this rank expects no drafts "
                r"\(expect_drafts = False; vLLM's recv_drafts\) but the last rank sent drafts",
    "width": r"rank 0: frame disagrees with this rank's view of the step "
             r"\(sample_width: mine 1 vs sender 3\)",
}


@pytest.mark.parametrize("case", sorted(MISMATCHES))
def test_a_drafts_or_width_mismatch_is_a_desync_error_on_every_rank(case: str) -> None:
    receiver, last = spawn_ranks(functools.partial(mismatch_rank, case), 2,
                                 timeout_s=SPAWN_TIMEOUT_S)
    assert re.match(MISMATCHES[case], receiver), receiver
    assert re.search(r"rank 0 reported: " + MISMATCHES[case], last), last


def test_a_rank_that_expects_drafts_never_hangs_when_none_come() -> None:
    """The same mismatch without a failure board: the receiver still raises
    at once (the frame went without drafts); no rank waits for a collective
    that does not come."""
    with pytest.raises(RankFailed) as info:
        spawn_ranks(_mismatch_no_board, 2, timeout_s=SPAWN_TIMEOUT_S)
    assert isinstance(info.value.errors.get(0), DesyncError), info.value.errors


def _mismatch_no_board(env: RankEnv) -> None:
    h = PPHandler(MAX_NUM_REQS, 1, CPU, timeout_s=WAIT_S, interface="0.33")
    batch = VllmInputBatch(
        num_reqs=1, idx_mapping=torch.tensor([0]), idx_mapping_np=np.array([0], np.intp),
        num_computed_tokens_np=np.array([9], np.int32),
        num_scheduled_tokens=np.array([1], np.int32), prefill_len_np=np.array([5], np.int32),
        is_prefilling_np=np.zeros(1, bool), max_seq_len_np=None, num_draft_tokens=0,
    )
    for _ in range(3):
        h.get_prev_sampled_outputs()
        if h.is_last_rank:
            h.broadcast(torch.tensor([[7]]), torch.tensor([1], dtype=torch.int32),
                        torch.tensor([0], dtype=torch.int32), batch)
        else:
            h.receive(batch, True)  # the last rank never calls broadcast_drafts
    h.close()
