"""ppsync.compat.vllm.PPHandler over real gloo groups, one process per rank.

An engine loop drives the adapter in vLLM's order with the synthetic workload
and checks every released step exactly against the step records of D steps
before; smaller tests cover a held step flushed at close(), the error paths
and the aux hidden-state relay.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

import numpy as np
import pytest
import torch
import torch.distributed as dist

from ppsync.compat.vllm import PPHandler, SampledOutputs
from ppsync.errors import BatchError, ConfigError, ProtocolError, RoleError
from ppsync.harness.checker import Checker
from ppsync.harness.launcher import RankEnv, spawn_ranks
from ppsync.harness.synthetic_workload import ScheduledStep, Workload, WorkloadConfig

CPU = torch.device("cpu")
MAX_NUM_REQS = 8
SPAWN_TIMEOUT_S = 45.0  # bound on a whole multi-process run
WAIT_S = 10.0  # the handlers' deadline: a failing rank's peers give up quickly
KEYS = ("sampled_tokens", "num_sampled", "num_rejected", "idx_mapping")


@dataclass(frozen=True, slots=True)
class InputBatch:
    """The attributes of vLLM's input batch that the adapter reads."""

    num_reqs: int
    idx_mapping: torch.Tensor  # [num_reqs] int64
    idx_mapping_np: np.ndarray  # [num_reqs] int64
    num_computed_tokens_np: np.ndarray  # [num_reqs] int64
    num_scheduled_tokens: np.ndarray  # [num_reqs] int64
    prefill_len_np: np.ndarray  # [num_reqs] int64
    max_seq_len_np: np.ndarray | None  # [num_reqs] int64
    is_prefilling_np: np.ndarray | None  # [num_reqs] bool


def batch_of(step: ScheduledStep) -> InputBatch:
    v = step.view
    return InputBatch(
        num_reqs=v.num_reqs,
        idx_mapping=torch.from_numpy(v.idx_mapping_np),
        idx_mapping_np=v.idx_mapping_np,
        num_computed_tokens_np=v.num_computed_tokens_np,
        num_scheduled_tokens=v.num_scheduled_tokens_np,
        prefill_len_np=v.prefill_len_np,
        max_seq_len_np=v.max_seq_len_np,
        is_prefilling_np=v.is_prefilling_np,
    )


def simple_batch(slots: list[int]) -> InputBatch:
    """Decode rows in ``slots``: every row needs a sample."""
    n = len(slots)
    idx_np = np.array(slots, dtype=np.int64)
    return InputBatch(
        num_reqs=n,
        idx_mapping=torch.from_numpy(idx_np),
        idx_mapping_np=idx_np,
        num_computed_tokens_np=np.full(n, 10, dtype=np.int64),
        num_scheduled_tokens=np.ones(n, dtype=np.int64),
        prefill_len_np=np.full(n, 5, dtype=np.int64),
        max_seq_len_np=None,
        is_prefilling_np=None,
    )


def draft_table(K: int, fill: int = -7) -> torch.Tensor:
    return torch.full((MAX_NUM_REQS, K), fill, dtype=torch.int64)  # [max_num_reqs, K]


# -- the engine loop ------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Scenario:
    pp_size: int
    K: int
    ring_depth: int | None = None
    steps: int = 60
    skip_drafts_every: int = 0  # the last rank skips broadcast_drafts on these steps
    last_calls_get_prev: bool = True  # False: held steps go at the next broadcast
    forward: bool = False  # stages pass hidden states (and a relayed aux) down the pipe
    seed: int = 0
    codec: Literal["host", "device"] = "host"  # device: torch-op frames (on CPU tensors here)

    @property
    def depth(self) -> int:
        return self.pp_size if self.ring_depth is None else self.ring_depth

    def skips_drafts(self, t: int) -> bool:
        return self.skip_drafts_every > 0 and t % self.skip_drafts_every == 1


@dataclass(slots=True)
class Seen:
    """What one receiver checked, so the parent can tell the run covered it."""

    rows_kept: int = 0
    rows_excluded: int = 0
    rows_with_drafts: int = 0
    rows_without_drafts: int = 0
    full_receives: int = 0


def check_release(
    sc: Scenario,
    checker: Checker,
    now: int,
    out: SampledOutputs | None,
    table: torch.Tensor | None,  # [max_num_reqs, K] after the call
    before: torch.Tensor | None,  # [max_num_reqs, K] before the call
    seen: Seen,
) -> None:
    rec = checker.workload.history.get(now - sc.depth)
    expected = np.zeros(0, bool) if rec is None else checker.expected_rows(rec, now)
    if rec is None or not expected.any():
        assert out is None, f"step {now}: released {out} where nothing was expected"
        assert table is None or before is None or torch.equal(table, before)
        return
    assert out is not None, f"step {now}: nothing released for step {rec.step}"
    assert tuple(out) == KEYS
    values = [out["sampled_tokens"], out["num_sampled"], out["num_rejected"], out["idx_mapping"]]
    assert [v.dtype for v in values] == [torch.int64, torch.int32, torch.int32, torch.int64]
    assert all(v.device == CPU for v in values)
    assert torch.equal(out["sampled_tokens"], torch.from_numpy(rec.tokens_np))
    assert torch.equal(out["num_sampled"], torch.from_numpy(rec.num_sampled_np))
    assert torch.equal(out["num_rejected"], torch.from_numpy(rec.num_rejected_np))
    idx = out["idx_mapping"].numpy()
    kept = idx != -1
    assert np.array_equal(kept, expected), f"step {rec.step}: kept {kept}, expected {expected}"
    assert np.array_equal(idx[kept], rec.view.idx_mapping_np[kept])
    seen.rows_kept += int(kept.sum())
    seen.rows_excluded += int((~kept).sum())
    if table is not None and before is not None:
        assert rec.drafts_np is not None
        want = before.clone()
        if sc.skips_drafts(rec.step):
            seen.rows_without_drafts += int(kept.sum())
        else:
            want[idx[kept]] = torch.from_numpy(rec.drafts_np[kept])
            seen.rows_with_drafts += int(kept.sum())
        assert torch.equal(table, want), f"step {rec.step}: draft table differs"


def forward(h: PPHandler, env: RankEnv, t: int) -> None:
    """A stage's forward of step t: wait for the previous stage's hidden
    states, pass its own on with the first stage's aux relayed. Like an
    engine's, it makes the last rank's broadcast wait on the other stages."""
    rank, last = env.rank, h.is_last_rank
    step = torch.tensor([t])
    if rank == 0:
        out: Mapping[str, torch.Tensor] = {"hidden_states": step, "aux_0": step * 10}
    else:
        buf = torch.empty(2, dtype=torch.int64)
        dist.recv(buf, src=rank - 1)
        up = {"hidden_states": buf[:1], "aux_0": buf[1:]}
        assert buf.tolist() == [t + rank - 1, t * 10], f"step {t}: {buf.tolist()}"
        out = h.relay_aux_hidden_states(up, {"hidden_states": step + rank})
    if not last:
        dist.send(torch.cat([out["hidden_states"], out["aux_0"]]), dst=rank + 1)


def engine_rank(sc: Scenario, env: RankEnv) -> Seen:
    """One rank of an engine calling the adapter in vLLM's order."""
    K = sc.K
    wl = Workload(WorkloadConfig(
        max_num_reqs=MAX_NUM_REQS, num_speculative_steps=K, ring_depth=sc.depth,
        seed=sc.seed, steps=sc.steps, abort_p=0.05, preempt_p=0.02,
    ))
    checker = Checker(wl)
    table = draft_table(K) if K else None
    rng = np.random.default_rng(sc.seed + 1000)
    seen = Seen()
    with PPHandler(MAX_NUM_REQS, K, CPU, ring_depth=sc.ring_depth, timeout_s=WAIT_S,
                   codec=sc.codec) as h:
        assert h.is_last_rank == (env.rank == sc.pp_size - 1)
        if sc.forward:
            h.configure_aux_hidden_state_relay(["aux_0"])
        for t in range(sc.steps + sc.depth):
            if not h.is_last_rank:
                before = None if table is None else table.clone()
                out = h.get_prev_sampled_outputs(table)
                check_release(sc, checker, t, out, table, before, seen)
            elif sc.last_calls_get_prev:
                assert h.get_prev_sampled_outputs() is None
            for slot in wl.begin_step(t):
                h.on_req_idx_freed(slot)
            step = wl.schedule(t)
            batch = batch_of(step)
            if sc.forward:
                forward(h, env, t)
            if h.is_last_rank:
                h.broadcast(
                    torch.from_numpy(step.tokens_np[:, : step.width]),
                    torch.from_numpy(step.num_sampled_np),
                    torch.from_numpy(step.num_rejected_np),
                    batch,
                )
                if K and not sc.skips_drafts(t):
                    assert step.drafts_np is not None
                    # noise in every slot; the step's drafts at its rows' slots
                    full = torch.from_numpy(rng.integers(-99, -10, (MAX_NUM_REQS, K)))
                    full[batch.idx_mapping] = torch.from_numpy(step.drafts_np)
                    h.broadcast_drafts(full, batch)
            else:
                every = h.receive(batch)
                assert every == bool(step.num_reqs and step.need_np.all()), f"step {t}"
                seen.full_receives += every
    return seen


SCENARIOS = [
    Scenario(pp_size=2, K=0),
    Scenario(pp_size=3, K=0, ring_depth=1),
    Scenario(pp_size=2, K=3, skip_drafts_every=5),
    # D = 1 with a forward: a step held for drafts that do not come must go at
    # the last rank's get_prev_sampled_outputs, or the receivers' consume and
    # the last rank's wait for hidden states deadlock
    Scenario(pp_size=2, K=3, ring_depth=1, skip_drafts_every=4, forward=True),
    Scenario(pp_size=3, K=3, skip_drafts_every=5, seed=1),
    Scenario(pp_size=3, K=3, ring_depth=1, skip_drafts_every=3, forward=True, seed=2),
    # D >= 2: held steps may wait for the next broadcast
    Scenario(pp_size=3, K=3, ring_depth=2, skip_drafts_every=3, last_calls_get_prev=False,
             forward=True),
    # the device codec (torch ops, deferred checks) through the same engine loop
    Scenario(pp_size=3, K=3, skip_drafts_every=5, seed=1, codec="device"),
    Scenario(pp_size=2, K=3, ring_depth=1, skip_drafts_every=4, forward=True, codec="device"),
    Scenario(pp_size=2, K=0, codec="device"),
]


@pytest.mark.parametrize("sc", SCENARIOS, ids=repr)
def test_engine_loop_delivers_every_row_exactly(sc: Scenario) -> None:
    seen = spawn_ranks(
        functools.partial(engine_rank, sc), sc.pp_size, timeout_s=SPAWN_TIMEOUT_S
    )
    receivers = seen[:-1]
    assert all(s.rows_kept > 0 for s in receivers)
    assert all(s.rows_excluded > 0 for s in receivers)
    assert all(s.full_receives > 0 for s in receivers)
    if sc.K:
        assert all(s.rows_with_drafts > 0 for s in receivers)
        assert all(s.rows_without_drafts > 0 for s in receivers)
    assert len({(s.rows_kept, s.rows_excluded) for s in receivers}) == 1


# -- a held step at close() ---------------------------------------------------------


def close_flush_rank(env: RankEnv) -> list[int]:
    """Last rank: broadcast() one step, no drafts, close(). Receiver: the frame
    arrives with its tokens and without drafts. Returns the tokens seen."""
    K, batch = 2, simple_batch([5, 2])
    h = PPHandler(MAX_NUM_REQS, K, CPU, timeout_s=WAIT_S)
    if h.is_last_rank:
        assert h.get_prev_sampled_outputs() is None
        tokens = torch.tensor([[11, 12], [21, -1]])
        ns, nr = torch.tensor([2, 1], dtype=torch.int32), torch.tensor([1, 2], dtype=torch.int32)
        h.broadcast(tokens, ns, nr, batch)
        # an engine refills its persistent buffers before the held step goes
        for t in (tokens, ns, nr, batch.idx_mapping):
            t.fill_(0)
        h.close()
        h.close()  # idempotent
        with pytest.raises(ProtocolError, match="after close"):
            h.get_prev_sampled_outputs()
        with pytest.raises(ProtocolError, match="after close"):
            h.broadcast_drafts(draft_table(K), batch)
        return []
    table = draft_table(K)
    assert h.get_prev_sampled_outputs(table) is None
    assert h.receive(batch) is True
    assert h.get_prev_sampled_outputs(table) is None  # D = 2: an empty ring slot
    assert h.receive(simple_batch([])) is False
    out = h.get_prev_sampled_outputs(table)
    assert out is not None
    assert out["idx_mapping"].tolist() == [5, 2]
    assert out["num_sampled"].tolist() == [2, 1]
    assert out["num_rejected"].tolist() == [1, 2]
    assert torch.equal(table, draft_table(K)), "a frame sent without drafts scattered some"
    h.close()
    received: list[int] = out["sampled_tokens"].flatten().tolist()
    return received


def test_close_sends_a_held_step_without_drafts() -> None:
    tokens, _ = spawn_ranks(close_flush_rank, 2, timeout_s=SPAWN_TIMEOUT_S)
    assert tokens == [11, 12, -1, 21, -1, -1]


# -- error paths -------------------------------------------------------------------


def errors_rank(env: RankEnv) -> list[int]:
    """Every error raised before a collective; the group stays usable after.
    Returns the drafts row the receiver got for slot 3."""
    K, batch, other = 2, simple_batch([3, 1]), simple_batch([1, 3])
    with pytest.raises(ConfigError, match="ring_depth"):
        PPHandler(MAX_NUM_REQS, K, CPU, ring_depth=3)
    with pytest.raises(ConfigError, match="max_num_reqs"):
        PPHandler(0, K, CPU)
    with pytest.raises(ConfigError, match="num_speculative_steps"):
        PPHandler(MAX_NUM_REQS, -1, CPU)
    h = PPHandler(MAX_NUM_REQS, K, CPU, ring_depth=2, timeout_s=WAIT_S)
    tokens = torch.tensor([[1, 2, 3], [4, 5, 6]])
    ns, nr = torch.tensor([3, 1], dtype=torch.int32), torch.tensor([0, 2], dtype=torch.int32)
    table = draft_table(K)
    table[3], table[1] = torch.tensor([30, 31]), torch.tensor([10, 11])
    if not h.is_last_rank:
        with pytest.raises(RoleError, match="last rank"):
            h.broadcast(tokens, ns, nr, batch)
        with pytest.raises(RoleError, match="last rank"):
            h.broadcast_drafts(table, batch)
        got = draft_table(K)
        assert h.get_prev_sampled_outputs(got) is None
        assert h.receive(batch) is True
        order = r"receive\(\) without a get_prev_sampled_outputs\(\)"
        with pytest.raises(ProtocolError, match=order):
            h.receive(batch)
        assert h.get_prev_sampled_outputs(got) is None
        assert h.receive(simple_batch([])) is False
        out = h.get_prev_sampled_outputs(got)
        assert out is not None
        assert out["sampled_tokens"].tolist() == [[1, 2, 3], [4, 5, 6]]
        assert got[1].tolist() == [10, 11]
        h.close()
        row: list[int] = got[3].tolist()
        return row
    with pytest.raises(RoleError, match="last rank"):
        h.receive(batch)
    assert h.get_prev_sampled_outputs() is None
    with pytest.raises(ProtocolError, match="without a held step"):
        h.broadcast_drafts(table, batch)
    with pytest.raises(BatchError, match=r"num_sampled\[0\] = 3"):
        h.broadcast(tokens[:, :2], ns, nr, batch)
    with pytest.raises(ProtocolError, match="without a held step"):
        h.broadcast_drafts(table, batch)  # a failed broadcast holds nothing
    h.broadcast(tokens, ns, nr, batch)
    with pytest.raises(BatchError, match=r"draft_tokens.shape"):
        h.broadcast_drafts(table[:, :1], batch)
    with pytest.raises(BatchError, match=r"idx_mapping\[0\] = 1"):
        h.broadcast_drafts(table, other)
    with pytest.raises(BatchError, match="num_reqs = 1"):
        h.broadcast_drafts(table, simple_batch([3]))
    h.broadcast_drafts(table, batch)  # still held after the errors
    with pytest.raises(ProtocolError, match="without a held step"):
        h.broadcast_drafts(table, batch)
    assert h.get_prev_sampled_outputs() is None
    h.broadcast(torch.zeros(0, 1, dtype=torch.int64), torch.zeros(0, dtype=torch.int32),
                torch.zeros(0, dtype=torch.int32), simple_batch([]))
    h.close()
    return []


def test_errors_leave_the_group_usable() -> None:
    row, _ = spawn_ranks(errors_rank, 2, timeout_s=SPAWN_TIMEOUT_S)
    assert row == [30, 31]


def test_needs_an_initialized_default_group() -> None:
    with pytest.raises(ConfigError, match="not initialized"):
        PPHandler(MAX_NUM_REQS, 0, CPU)


# -- one rank: K = 0 drafts and the aux relay -----------------------------------------


@dataclass(frozen=True, slots=True)
class Intermediate:
    """Like vLLM's IntermediateTensors: a mapping under ``.tensors``."""

    tensors: dict[str, torch.Tensor]


def single_rank(env: RankEnv) -> None:
    h = PPHandler(MAX_NUM_REQS, 0, CPU, group=None, timeout_s=WAIT_S)
    assert h.is_last_rank
    batch = simple_batch([0])
    assert h.get_prev_sampled_outputs() is None
    h.broadcast(torch.tensor([[7]]), torch.tensor([1], dtype=torch.int32),
                torch.tensor([0], dtype=torch.int32), batch)
    with pytest.raises(BatchError, match="num_speculative_steps = 0"):
        h.broadcast_drafts(torch.zeros(MAX_NUM_REQS, 1, dtype=torch.int64), batch)

    hidden, aux0, aux1 = torch.ones(2, 4), torch.zeros(2, 4), torch.full((2, 4), 2.0)
    out = {"hidden_states": hidden}
    assert h.relay_aux_hidden_states(None, out) == out  # no keys: output unchanged
    h.configure_aux_hidden_state_relay(["aux_0", "aux_1"])
    up = Intermediate({"hidden_states": torch.zeros(1), "aux_0": aux0, "aux_1": aux1})
    relayed = h.relay_aux_hidden_states(up, Intermediate(out))
    assert type(relayed) is Intermediate  # the type it was given, rebuilt
    merged = relayed.tensors
    assert set(merged) == {"hidden_states", "aux_0", "aux_1"}
    assert merged["hidden_states"] is hidden
    assert merged["aux_0"] is aux0
    assert merged["aux_1"] is aux1
    assert set(out) == {"hidden_states"}  # the caller's mapping is not modified
    with pytest.raises(BatchError, match="no upstream"):
        h.relay_aux_hidden_states(None, out)
    with pytest.raises(BatchError, match="'aux_1' missing"):
        h.relay_aux_hidden_states({"aux_0": aux0}, out)
    with pytest.raises(ConfigError, match="one string"):
        h.configure_aux_hidden_state_relay("aux_0")
    h.configure_aux_hidden_state_relay([])
    assert h.relay_aux_hidden_states(None, out) == out
    h.close()


def test_single_rank_drafts_and_aux_relay() -> None:
    assert spawn_ranks(single_rank, 1, timeout_s=SPAWN_TIMEOUT_S) == [None]
