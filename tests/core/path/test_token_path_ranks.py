"""TokenPath on real gloo ranks: the synthetic workload arrives exactly once
and intact on every receiver, and a divergent batch view is a DesyncError.

Each world is P forked processes on 127.0.0.1 (``spawn_ranks``); every wait
is bounded by ``timeout_s``, so a hang fails the test instead of stalling it.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

import numpy as np
import pytest
import torch
import torch.distributed as dist
from helpers import decode_view
from twin_mode import Mode, check_engine_stream, in_mode, mode_group

from ppsync.core import SampledStep
from ppsync.core.path.token_path import TokenPath
from ppsync.core.wire.groups import token_group
from ppsync.errors import DesyncError
from ppsync.harness.driver import run_sync_rank, workload_config
from ppsync.harness.launcher import RankEnv, spawn_ranks
from ppsync.harness.synthetic_workload import Workload, WorkloadConfig
from ppsync.schemas.config import SyncConfig, WireMode
from ppsync.schemas.run_report import RankReport

TIMEOUT_S = 20.0
STEPS = 300
SEED = 7

# High abort/preempt rates free request slots while their rows are in flight
# and reuse them at once; long prompts in short chunks give steps whose rows
# are all non-final prefill chunks (no transfer); a short idle period gives
# arrival pauses in which batches run empty.
KNOBS: dict[str, object] = {
    "arrival_p": 0.6,
    "abort_p": 0.08,
    "preempt_p": 0.02,
    "prompt_len": (1, 64),
    "max_tokens": (1, 12),
    "chunk": (2, 8),
    "idle_every": 25,
}


def _path(config: SyncConfig, mode: Mode = "gloo") -> TokenPath:
    group = token_group(dist.group.WORLD, timeout_s=config.timeout_s)  # type: ignore[arg-type]
    return TokenPath(config, mode_group(group, mode))


def _workload_rank(
    config: SyncConfig, mode: Mode, env: RankEnv
) -> tuple[RankReport, WorkloadConfig]:
    wcfg = workload_config(config, steps=STEPS, seed=SEED, **KNOBS)
    report = run_sync_rank(_path(config, mode), wcfg)
    check_engine_stream(mode)
    return report, wcfg


@dataclass(frozen=True, slots=True)
class Survey:
    """What the workload alone does, replayed in the parent without ranks."""

    empty_steps: int  # num_reqs == 0
    no_transfer_steps: int  # num_reqs > 0, yet no row samples (seq == -1)
    transfers: int  # steps with a frame
    rows_needed: int  # rows the last rank sends
    reused_within_depth: int  # rows on a slot freed < D steps earlier, by a new request
    freed_in_flight: int  # rows needing a sample whose slot was freed before release
    all_freed_in_flight: int  # steps with a frame whose every needed row was freed so


def _survey(wcfg: WorkloadConfig) -> Survey:
    wl = Workload(wcfg)
    depth = wcfg.ring_depth
    empty = no_transfer = transfers = needed = reused = 0
    last_free: dict[int, tuple[int, int]] = {}  # slot -> (step freed, request id)
    # step -> (idx_mapping, need, rows freed since the step was posted)
    posted: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
    for t in range(wcfg.steps + depth):
        owner = {slot: req.req_id for slot, req in wl.live.items()}
        freed = wl.begin_step(t)
        for slot in freed:
            last_free[slot] = (t, owner[slot])
            # step s is released at s + D, before that step frees anything
            for s in range(max(0, t - depth + 1), t):
                idx, need, gone = posted[s]
                gone |= need & (idx == slot)
        step = wl.schedule(t)
        posted[t] = (step.view.idx_mapping_np, step.need_np, np.zeros(step.num_reqs, bool))
        if t >= wcfg.steps:
            assert step.num_reqs == 0  # the drain steps are empty
            continue
        if step.num_reqs == 0:
            empty += 1
        elif step.seq == -1:
            no_transfer += 1
        else:
            transfers += 1
        needed += int(step.need_np.sum())
        for slot, req_id in zip(step.view.idx_mapping_np, step.req_ids_np, strict=True):
            f = last_free.get(int(slot))
            if f is not None and f[1] != int(req_id) and t - f[0] < depth:
                reused += 1
    in_flight = sum(int(gone.sum()) for _, _, gone in posted.values())
    all_gone = sum(
        1 for _, need, gone in posted.values() if need.any() and gone[need].all()
    )
    return Survey(empty, no_transfer, transfers, needed, reused, in_flight, all_gone)


# (P, K, D, max_num_reqs, wire); D = 0 stands for "pp_size" (the default).
CASES: list[tuple[int, int, int, int, WireMode]] = [
    (2, 0, 0, 8, "fixed"),
    (2, 3, 1, 64, "exact"),
    (2, 3, 0, 64, "fixed"),
    (3, 0, 0, 64, "exact"),
    (3, 3, 1, 8, "fixed"),
    (3, 3, 0, 8, "exact"),
    (4, 3, 0, 8, "fixed"),
    (4, 0, 1, 64, "exact"),
]
MODE_CASES: list[tuple[int, int, int, int, WireMode, Mode]] = [
    *[(p, k, d, m, w, "gloo") for p, k, d, m, w in CASES],
    # the CPU twin of NCCL: device frames, fixed wire
    (2, 0, 0, 8, "fixed", "twin"),
    (3, 3, 1, 8, "fixed", "twin"),
    (3, 3, 0, 64, "fixed", "twin"),
    # the host carrier on the twin of a CUDA device: copies through pinned memory
    (2, 0, 0, 8, "fixed", "carried"),
    (3, 3, 1, 8, "fixed", "carried"),
    (3, 3, 0, 64, "fixed", "carried"),
]


@pytest.mark.parametrize(
    ("pp_size", "spec", "ring_depth", "max_num_reqs", "wire", "mode"),
    MODE_CASES,
    ids=[f"P{p}-K{k}-D{d or p}-M{m}-{w}-{c}" for p, k, d, m, w, c in MODE_CASES],
)
def test_workload_arrives_exactly_once(
    pp_size: int, spec: int, ring_depth: int, max_num_reqs: int, wire: WireMode, mode: Mode
) -> None:
    config = in_mode(SyncConfig.build(
        pp_size=pp_size,
        max_num_reqs=max_num_reqs,
        num_speculative_steps=spec,
        ring_depth=ring_depth or None,
        timeout_s=TIMEOUT_S,
        wire=wire,
    ), mode)
    depth = config.depth
    wcfg = workload_config(config, steps=STEPS, seed=SEED, **KNOBS)
    assert (wcfg.ring_depth, wcfg.num_speculative_steps) == (depth, spec)
    survey = _survey(wcfg)
    # the workload provably contains the cases this run is meant to cover
    assert survey.empty_steps > 0, survey
    assert survey.no_transfer_steps > 0, survey
    assert survey.reused_within_depth > 0, survey
    if depth > 1:
        # rows dropped at consume time, and consumes with nothing left to wait for
        assert survey.freed_in_flight > 0, survey
        assert survey.all_freed_in_flight > 0, survey
    assert survey.transfers > 0, survey

    results = spawn_ranks(
        functools.partial(_workload_rank, config, mode), pp_size, timeout_s=TIMEOUT_S
    )
    reports = [r for r, _ in results]
    for _, rank_wcfg in results:
        assert rank_wcfg == wcfg  # the ranks ran the workload surveyed above

    assert [r.rank for r in reports] == list(range(pp_size))
    assert [r.role for r in reports] == ["receiver"] * (pp_size - 1) + ["last"]
    for r in reports:
        assert r.steps == STEPS
        # every rank took the same transfer decision on every step
        assert r.transfers == survey.transfers, r
    last = reports[-1]
    assert last.rows_sent == survey.rows_needed
    for r in reports[:-1]:
        assert (r.lost, r.stale, r.duplicated, r.corrupt) == (0, 0, 0, 0), r
        assert r.rows_delivered == r.rows_expected > 0, r
        # rows whose slot was freed in flight were dropped, not delivered
        assert r.rows_expected == survey.rows_needed - survey.freed_in_flight, r


# -- a divergent batch view --------------------------------------------------

MAX_NUM_REQS = 8
DIVERGENT = 0  # the receiver whose scheduler disagrees with the others




def _tokens(step: int, n: int) -> torch.Tensor:
    return torch.arange(n, dtype=torch.int64).reshape(n, 1) + 100 * step


# Per step: (the sender's and agreeing receivers' idx_mapping, the divergent
# receiver's). Step 2 agrees again: the group must still work after a desync.
PLAN: list[tuple[list[int], list[int]]] = [
    ([0, 1, 2], [0, 1, 3]),  # same num_reqs, different request slots
    ([4, 5, 6], [4, 5]),  # different num_reqs (fixed wire: same frame size)
    ([1, 2], [1, 2]),
]

@dataclass(frozen=True, slots=True)
class Seen:
    """One call's outcome on a rank, returned to the parent."""

    kind: str  # "sent", "none", "released", "DesyncError" (type name), "closed"
    values: tuple[int, ...] = ()  # sent: rows; released: first token of each row
    idx: tuple[int, ...] = ()  # released: idx_mapping
    message: str = ""
    expected: dict[str, int] | None = None
    received: dict[str, int] | None = None


def _desync_rank(config: SyncConfig, env: RankEnv) -> list[Seen]:
    # no failure board: the divergent receiver goes on after its DesyncError, and
    # the other ranks must not learn of it (with a board they raise it too)
    group = token_group(dist.group.WORLD, timeout_s=config.timeout_s)  # type: ignore[arg-type]
    path = TokenPath(config, group, board=None)
    out: list[Seen] = []
    if path.is_last:
        for step, (idx, _) in enumerate(PLAN):
            n = len(idx)
            sent = path.publish(decode_view(idx), SampledStep(
                _tokens(step, n), torch.ones(n, dtype=torch.int32),
                torch.zeros(n, dtype=torch.int32)))
            out.append(Seen("sent", (sent,)))
        path.close()  # drains: returns only once every broadcast completed
        out.append(Seen("closed"))
        return out
    for step in range(len(PLAN) + 1):
        try:
            released = path.consume()
        except DesyncError as e:
            out.append(Seen(type(e).__name__, message=str(e), expected=e.expected,
                            received=e.received))
        else:
            if released is None:
                out.append(Seen("none"))
            else:
                out.append(Seen(
                    "released",
                    tuple(int(x) for x in released.sampled_tokens[:, 0]),
                    tuple(int(x) for x in released.idx_mapping),
                ))
        if step < len(PLAN):
            agreed, mine = PLAN[step]
            path.post(decode_view(mine if env.rank == DIVERGENT else agreed))
    path.close()
    out.append(Seen("closed"))
    return out


def test_divergent_batch_view_is_a_desync_error() -> None:
    config = SyncConfig.build(
        pp_size=3, max_num_reqs=MAX_NUM_REQS, ring_depth=1, timeout_s=TIMEOUT_S, wire="fixed"
    )
    divergent, agreeing, last = spawn_ranks(
        functools.partial(_desync_rank, config), 3, timeout_s=TIMEOUT_S
    )
    # the sender completed every broadcast although one receiver disagreed
    assert last == [Seen("sent", (3,)), Seen("sent", (3,)), Seen("sent", (2,)), Seen("closed")]

    # the agreeing receiver gets every step, intact
    assert agreeing == [
        Seen("none"),
        *(
            Seen("released", tuple(100 * step + i for i in range(len(idx))), tuple(idx))
            for step, (idx, _) in enumerate(PLAN)
        ),
        Seen("closed"),
    ]

    assert len(divergent) == len(PLAN) + 2
    assert divergent[0] == Seen("none")
    slots = divergent[1]  # same num_reqs, other request slots
    assert slots.kind == "DesyncError", slots
    assert slots.expected is not None and slots.received is not None
    # the frame's row facts name the first row whose request slot differs
    assert re.search(r"row \d+ disagrees with this rank's view: idx_mapping\[\d+\] mine \d+ "
                     r"vs sender \d+", slots.message), slots.message
    assert "num_reqs" not in slots.message  # only the fields that differ are named
    assert slots.expected["seq"] == slots.received["seq"] == 0
    assert slots.expected["num_reqs"] == slots.received["num_reqs"] == 3
    assert slots.expected["idx_digest"] != slots.received["idx_digest"]

    count = divergent[2]  # fewer rows than the sender's batch
    assert count.kind == "DesyncError", count
    assert count.expected is not None and count.received is not None
    assert re.search(r"num_reqs: mine 2 vs sender 3", count.message), count.message
    assert count.expected["seq"] == count.received["seq"] == 1
    assert (count.expected["num_reqs"], count.received["num_reqs"]) == (2, 3)

    # once the views agree again, the divergent receiver is served normally
    assert divergent[3] == Seen("released", (200, 201), (1, 2))
    assert divergent[4] == Seen("closed")
