"""Hypothesis fuzzing of ppsync.compat.vllm.PPHandler's public methods, on
real gloo ranks.

The world of fault_fuzz_calls: P = 2 (rank 0 receives, rank 1 is the last
rank), D = 1, K = 2. First each rank, on its own, makes bad constructor calls
(each must raise ConfigError before any collective, or the peer's handler
could not be built); then both build the handler. Both ranks generate the
same schedule of bad calls with derandomized hypothesis (compared through the
run's store); in round r the offending rank makes one bad call at its place
in vLLM's order (``get_prev_sampled_outputs``, ``on_req_idx_freed``,
``receive`` / ``broadcast`` + ``broadcast_drafts``), then both ranks run a
valid step r, which the receiver checks exactly one round later, drafts
included. Last, every method is called after ``close()``.

Every bad call, constructor calls included, must raise a PPSyncError
subclass whose message names the argument or field (or the call: an order
error names the adapter's method, not the token path's), and leave the token
path (seq, steps, ring, works in flight) and the held step as they were.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import numpy as np
import pytest
import torch
from fault_fuzz_calls import (
    BASE_IDX,
    BASE_R,
    COMPUTED,
    FREE_BAD,
    LAST,
    MAX_NUM_REQS,
    NUM_REJECTED,
    NUM_SAMPLED,
    OUTPUT_BAD,
    PREFILL_LEN,
    RECEIVER,
    SCHEDULED,
    TIMEOUT_S,
    VIEW_BAD,
    Attempt,
    BadCall,
    K,
    State,
    agree,
    attempt,
    calls,
    drafts,
    outputs,
    path_state,
    report,
    slots,
    tokens,
)
from fault_fuzz_inputs import Bad, bad_int, collect, int_tensor, replace_field, uniform
from fault_tools import watchdog
from hypothesis import strategies as st

from ppsync.compat.vllm import PPHandler
from ppsync.harness.launcher import RankEnv, spawn_ranks

CPU = torch.device("cpu")
EXAMPLES = 200  # rounds, one bad call each
CTOR_EXAMPLES = 40  # bad constructor calls, per rank
AFTER_CLOSE_EXAMPLES = 30


@dataclass(frozen=True, slots=True)
class InputBatch:
    """The attributes of vLLM's input batch that the adapter reads."""

    num_reqs: int
    idx_mapping_np: np.ndarray  # [num_reqs] int64
    num_computed_tokens_np: np.ndarray  # [num_reqs] int64
    num_scheduled_tokens: np.ndarray  # [num_reqs] int64
    prefill_len_np: np.ndarray  # [num_reqs] int64
    max_seq_len_np: np.ndarray | None = None  # [num_reqs] int64
    is_prefilling_np: np.ndarray | None = None  # [num_reqs] bool


def _batch(idx: list[int]) -> InputBatch:
    """Decode rows in request slots ``idx``: every row needs a sample."""
    n = len(idx)
    return InputBatch(
        num_reqs=n,
        idx_mapping_np=np.array(idx, dtype=np.int64),
        num_computed_tokens_np=np.full(n, COMPUTED, dtype=np.int64),
        num_scheduled_tokens=np.full(n, SCHEDULED, dtype=np.int64),
        prefill_len_np=np.full(n, PREFILL_LEN, dtype=np.int64),
    )


def _draft_table(r: int) -> torch.Tensor:  # [max_num_reqs, K] int64, by request slot
    table = torch.full((MAX_NUM_REQS, K), -3, dtype=torch.int64)
    table[torch.tensor(slots(r))] = torch.from_numpy(drafts(r))
    return table


BASE = _batch(BASE_IDX)

# -- the schedule ---------------------------------------------------------------------

When = Literal["before_get", "after_get", "after_receive", "after_broadcast", "after_drafts"]
RECEIVER_HOOKS: list[When] = ["before_get", "after_get", "after_receive"]
LAST_HOOKS: list[When] = ["before_get", "after_get", "after_broadcast", "after_drafts"]

BATCH_BAD = {("num_scheduled_tokens" if a == "num_scheduled_tokens_np" else a): b
             for a, b in VIEW_BAD.items()}
# no input batch at all, or one without the attributes the adapter reads
NOT_A_BATCH = st.sampled_from([("None", None), ("dict", {"num_reqs": 3}), ("int", 3),
                               ("a tensor", torch.zeros(3))]).map(
    lambda tv: Bad("input_batch", "type", tv[0], tv[1]))
TABLE = torch.full((MAX_NUM_REQS, K), -1, dtype=torch.int64)
TARGET_BAD = int_tensor("draft_tokens_to_update", TABLE, optional=True, bad_widths=[0, 1, K + 1])
DRAFT_TABLE_BAD = int_tensor("draft_tokens", TABLE, bad_widths=[0, 1, K + 1])
KEYS_BAD = st.sampled_from([
    ("one str", "hidden"), ("empty name", ["a", ""]), ("int name", ["a", 3]),
    ("twice", ["a", "a"]), ("None", None), ("int", 3),
]).map(lambda tv: Bad("key", "type", tv[0], tv[1]))
RELAY_BAD = st.sampled_from([("None", None), ("int", 3), ("list", [torch.zeros(1)])]).map(
    lambda tv: Bad("output_intermediate_tensors", "type", tv[0], tv[1]))
# broadcast_drafts with another step's batch than the held one
OTHER_BATCH = st.sampled_from([
    ("2 rows", _batch(BASE_IDX[:2])), ("4 rows", _batch([*BASE_IDX, 0])),
    ("other slots", _batch([2, 5, 6])), ("permuted", _batch([5, 2, 7])),
]).map(lambda tv: Bad("input_batch", "mismatch", tv[0], tv[1]))


def _batch_targets(rank: int, when: When, method: str) -> list[st.SearchStrategy[BadCall]]:
    out = [calls(BATCH_BAD[a], rank, when, method, a, "BatchError") for a in sorted(BATCH_BAD)]
    out.append(calls(NOT_A_BATCH, rank, when, method, "input_batch", "BatchError"))
    return out


def _shared_targets(rank: int, hooks: list[When]) -> list[st.SearchStrategy[BadCall]]:
    h = st.sampled_from(hooks)
    return [
        st.tuples(h, FREE_BAD).map(
            lambda hb: BadCall(rank, hb[0], "on_req_idx_freed", "req_idx", "BatchError", hb[1])),
        st.tuples(h, KEYS_BAD).map(lambda hb: BadCall(
            rank, hb[0], "configure_aux_hidden_state_relay", "keys", "ConfigError", hb[1])),
        st.tuples(h, RELAY_BAD).map(lambda hb: BadCall(
            rank, hb[0], "relay_aux_hidden_states", "output", "BatchError", hb[1])),
    ]


def _receiver_targets() -> list[st.SearchStrategy[BadCall]]:
    orders: list[tuple[When, str, str]] = [
        ("before_get", "receive", "receive()"),
        ("after_receive", "receive", "receive()"),
    ]  # get_prev_sampled_outputs() twice is an empty-schedule step, not an error
    roles = [("broadcast", "broadcast()"), ("broadcast_drafts", "broadcast_drafts()")]
    return [
        *_batch_targets(RECEIVER, "after_get", "receive"),
        calls(TARGET_BAD, RECEIVER, "before_get", "get_prev_sampled_outputs",
              "draft_tokens_to_update", "BatchError"),
        st.sampled_from(orders).map(lambda o: BadCall(
            RECEIVER, o[0], o[1], "", "ProtocolError", Bad(o[2], "order", o[0], None))),
        st.tuples(st.sampled_from(RECEIVER_HOOKS), st.sampled_from(roles)).map(
            lambda hr: BadCall(RECEIVER, hr[0], hr[1][0], "", "RoleError",
                               Bad(hr[1][1], "role", "", None))),
        *_shared_targets(RECEIVER, RECEIVER_HOOKS),
    ]


def _last_targets() -> list[st.SearchStrategy[BadCall]]:
    orders: list[tuple[When, str, str]] = [
        ("after_get", "broadcast_drafts", "broadcast_drafts()"),
        ("after_drafts", "broadcast_drafts", "broadcast_drafts()"),
    ]
    return [
        *_batch_targets(LAST, "after_get", "broadcast"),
        *[calls(OUTPUT_BAD[a], LAST, "after_get", "broadcast", a, "BatchError")
          for a in sorted(OUTPUT_BAD)],
        *_batch_targets(LAST, "after_broadcast", "broadcast_drafts"),
        calls(DRAFT_TABLE_BAD, LAST, "after_broadcast", "broadcast_drafts", "draft_tokens",
              "BatchError"),
        calls(OTHER_BATCH, LAST, "after_broadcast", "broadcast_drafts", "input_batch",
              "BatchError"),
        st.sampled_from(orders).map(lambda o: BadCall(
            LAST, o[0], o[1], "", "ProtocolError", Bad(o[2], "order", o[0], None))),
        st.sampled_from(LAST_HOOKS).map(lambda w: BadCall(
            LAST, w, "receive", "", "RoleError", Bad("receive()", "role", "", None))),
        *_shared_targets(LAST, LAST_HOOKS),
    ]


def bad_calls() -> st.SearchStrategy[BadCall]:
    return uniform(_receiver_targets() + _last_targets())


# -- making the calls ----------------------------------------------------------------------


def _make(h: PPHandler, call: BadCall) -> None:
    bad, arg = call.bad, call.arg
    batch: object = BASE
    if arg == "input_batch":
        batch = bad.value
    elif arg in BATCH_BAD:
        batch = replace_field(BASE, arg, bad.value)
    m = call.entry
    if m == "receive":
        h.receive(batch)
    elif m == "get_prev_sampled_outputs":
        h.get_prev_sampled_outputs(bad.value if arg else None)  # type: ignore[arg-type]
    elif m == "broadcast":
        outs = outputs(BASE_R)
        if arg in OUTPUT_BAD:
            outs[arg] = bad.value
        h.broadcast(input_batch=batch, **outs)  # type: ignore[arg-type]
    elif m == "broadcast_drafts":
        table = bad.value if arg == "draft_tokens" else _draft_table(BASE_R)
        if call.when == "after_broadcast" and arg in ("", "draft_tokens"):
            batch = CURRENT[0]  # the held step's own batch
        h.broadcast_drafts(table, batch)  # type: ignore[arg-type]
    elif m == "on_req_idx_freed":
        h.on_req_idx_freed(bad.value)  # type: ignore[arg-type]
    elif m == "configure_aux_hidden_state_relay":
        h.configure_aux_hidden_state_relay(bad.value)  # type: ignore[arg-type]
    elif m == "relay_aux_hidden_states":
        h.relay_aux_hidden_states(None, bad.value)
    else:
        raise AssertionError(f"unknown method {m}")


# broadcast_drafts right after broadcast must name the held step's batch; the
# rank loop keeps the current round's batch here
CURRENT: list[InputBatch] = [BASE]


def _state(h: PPHandler) -> State:
    """The token path's state, and whether the adapter holds a step."""
    held = getattr(h, "_held") is not None  # noqa: B009  (private: the adapter's held step)
    return (*path_state(h.token_path), held)


def _attempt(h: PPHandler, call: BadCall,
             make: Callable[[PPHandler, BadCall], None] = _make) -> Attempt:
    return attempt(call, functools.partial(make, h, call), functools.partial(_state, h))


# -- constructor calls: each rank alone, before the handlers exist -------------------------

CTOR_VALID: dict[str, object] = {"max_num_reqs": MAX_NUM_REQS, "num_speculative_steps": K,
                                 "device": CPU, "ring_depth": 1, "timeout_s": TIMEOUT_S}
CTOR_BAD: dict[str, st.SearchStrategy[Bad]] = {
    "max_num_reqs": bad_int("max_num_reqs", 1, 2**20 + 1),
    "num_speculative_steps": bad_int("num_speculative_steps", 0, 65),
    "ring_depth": st.sampled_from([0, -1, 3, 2**62, 1.0, "1", True]).map(
        lambda v: Bad("ring_depth", "range" if isinstance(v, int) else "type", repr(v), v)),
    "timeout_s": st.sampled_from([0, -1.0, 86401.0, float("inf"), float("nan"), "10", None,
                                  True, 10**400]).map(
        lambda v: Bad("timeout_s", "range", repr(v)[:20], v)),
    "device": st.sampled_from(["nonsense", "cuda:x", None, 3.5]).map(
        lambda v: Bad("device", "type", repr(v), v)),
}
CTOR_CALLS = uniform([calls(CTOR_BAD[a], -1, "before_get", "__init__", a, "ConfigError")
                      for a in sorted(CTOR_BAD)])


def _construct(call: BadCall) -> None:
    kwargs = dict(CTOR_VALID)
    kwargs[call.arg] = call.bad.value
    PPHandler(**kwargs)  # type: ignore[arg-type]


# -- the ranks ----------------------------------------------------------------------------


@dataclass(frozen=True)
class RankRun:
    ctor: list[Attempt]
    attempts: list[Attempt]
    releases: int
    wrong: list[str]
    after_close: list[Attempt]


def _check_release(h: PPHandler, table: torch.Tensor, r: int, wrong: list[str]) -> int:
    out = h.get_prev_sampled_outputs(table)
    if r == 0:
        if out is not None:
            wrong.append("round 0 released a step from an empty ring")
        return 0
    s = r - 1
    if out is None:
        wrong.append(f"round {s}'s step was not released")
        return 0
    values = [out["sampled_tokens"], out["num_sampled"], out["num_rejected"], out["idx_mapping"]]
    got = ({k: v.tolist() for k, v in zip(out, values, strict=True)},
           table[torch.tensor(slots(s))].tolist())
    want = ({"sampled_tokens": tokens(s).tolist(), "num_sampled": NUM_SAMPLED,
             "num_rejected": NUM_REJECTED, "idx_mapping": slots(s)}, drafts(s).tolist())
    if got != want:
        wrong.append(f"round {s}: got {got}, sent {want}")
    return 1


CLOSED_METHODS = ["get_prev_sampled_outputs", "receive", "on_req_idx_freed", "broadcast",
                  "broadcast_drafts"]


def _after_close_calls(rank: int) -> st.SearchStrategy[BadCall]:
    closed = Bad("close()", "order", "after close()", None)
    return st.sampled_from(CLOSED_METHODS).map(
        lambda m: BadCall(rank, "after_get", m, "", "ProtocolError", closed))


def _closed_call(h: PPHandler, call: BadCall) -> None:
    """A valid call of ``call.entry``, on a closed handler."""
    m = call.entry
    if m == "get_prev_sampled_outputs":
        h.get_prev_sampled_outputs(None)
    elif m == "receive":
        h.receive(BASE)
    elif m == "on_req_idx_freed":
        h.on_req_idx_freed(3)
    elif m == "broadcast":
        h.broadcast(input_batch=BASE, **outputs(BASE_R))  # type: ignore[arg-type]
    else:
        h.broadcast_drafts(_draft_table(BASE_R), BASE)


def _handler_rank(kernels: str, env: RankEnv) -> RankRun:
    watchdog(TIMEOUT_S + 30)
    ctor = [attempt(c, functools.partial(_construct, c))
            for c in collect(CTOR_CALLS, CTOR_EXAMPLES)]
    schedule = collect(bad_calls(), EXAMPLES)
    agree(env, "vllm", schedule)
    h = PPHandler(MAX_NUM_REQS, K, CPU, ring_depth=1, timeout_s=TIMEOUT_S,
                  cpu_kernels=kernels)  # type: ignore[arg-type]
    assert h.is_last_rank == (env.rank == LAST)
    attempts: list[Attempt] = []
    wrong: list[str] = []
    releases = 0
    table = torch.full((MAX_NUM_REQS, K), -1, dtype=torch.int64)  # [max_num_reqs, K]

    def bad(when: When, call: BadCall) -> None:
        if call.rank == env.rank and call.when == when:
            attempts.append(_attempt(h, call))

    for r, call in enumerate(schedule):
        batch = _batch(slots(r))
        CURRENT[0] = batch
        bad("before_get", call)
        if h.is_last_rank:
            assert h.get_prev_sampled_outputs() is None
            bad("after_get", call)
            h.broadcast(input_batch=batch, **outputs(r))  # type: ignore[arg-type]
            bad("after_broadcast", call)
            h.broadcast_drafts(_draft_table(r), batch)
            bad("after_drafts", call)
        else:
            releases += _check_release(h, table, r, wrong)
            bad("after_get", call)
            assert h.receive(batch) is True  # every row needs a sample
            bad("after_receive", call)
    if not h.is_last_rank:
        releases += _check_release(h, table, len(schedule), wrong)
        h.receive(_batch([]))
    h.close()
    after_close = [_attempt(h, c, _closed_call)
                   for c in collect(_after_close_calls(env.rank), AFTER_CLOSE_EXAMPLES)]
    return RankRun(ctor, attempts, releases, wrong, after_close)


KERNELS = ("numpy", "numba")
"""The CPU kernel sets (SyncConfig.cpu_kernels): each runs the whole fuzz."""
_WORLDS: dict[str, list[RankRun]] = {}


def _world(kernels: str) -> list[RankRun]:
    if kernels not in _WORLDS:
        _WORLDS[kernels] = spawn_ranks(functools.partial(_handler_rank, kernels), 2,
                                       timeout_s=TIMEOUT_S + 20)
    return _WORLDS[kernels]


@pytest.fixture(scope="module", params=KERNELS)
def world(request: pytest.FixtureRequest) -> list[RankRun]:
    return _world(request.param)


# -- the checks ---------------------------------------------------------------------------


def test_schedule_covers_every_method(world: list[RankRun]) -> None:
    attempts = [a for run in world for a in run.attempts]
    assert len(attempts) == EXAMPLES
    assert {a.entry for a in attempts} == {
        "receive", "get_prev_sampled_outputs", "broadcast", "broadcast_drafts",
        "on_req_idx_freed", "configure_aux_hidden_state_relay", "relay_aux_hidden_states",
    }
    assert {a.kind for a in attempts} >= {"type", "dtype", "shape", "range", "mismatch",
                                          "role", "order"}
    # order errors of receive(); keys that are no list of names at all
    assert ("receive", "order") in {(a.entry, a.kind) for a in attempts}
    assert {a.label for a in attempts if a.entry == "configure_aux_hidden_state_relay"} & {
        "None", "int"}
    assert {a.arg for a in world[0].ctor + world[1].ctor} == set(CTOR_BAD)


def test_every_bad_constructor_call_is_a_config_error(world: list[RankRun]) -> None:
    attempts = [a for run in world for a in run.ctor]
    assert len(attempts) == 2 * CTOR_EXAMPLES  # both ranks
    assert report(attempts) == []


def test_every_bad_call_raises_a_typed_error_before_any_collective(
    world: list[RankRun],
) -> None:
    attempts = [a for run in world for a in run.attempts]
    assert len(attempts) == EXAMPLES
    assert report(attempts) == []


def test_the_group_completes_a_valid_step_after_every_bad_call(world: list[RankRun]) -> None:
    receiver, _ = world
    assert receiver.wrong == []
    assert receiver.releases == EXAMPLES  # every valid step arrived, drafts included


def test_every_method_after_close_is_a_protocol_error(world: list[RankRun]) -> None:
    for run in world:
        # hypothesis stops once it has tried every method (a small space)
        assert {a.entry for a in run.after_close} == set(CLOSED_METHODS)
        assert report(run.after_close) == []


def test_every_kernel_set_raises_the_same_errors() -> None:
    """The same schedule through each CPU kernel set: the same error type
    and message for every bad call, on every rank."""
    ref = _world(KERNELS[0])
    for kernels in KERNELS[1:]:
        for r, (a, b) in enumerate(zip(ref, _world(kernels), strict=True)):
            assert [(x.call, x.error, x.message) for x in a.attempts] == [
                (x.call, x.error, x.message) for x in b.attempts], (kernels, r)
