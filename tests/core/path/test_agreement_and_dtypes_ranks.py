"""Ranks that disagree on a batch, and narrow dtypes, on real gloo ranks
(P = 2: rank 0 receives, rank 1 is the last rank); each case once passed
silently or escaped untyped:

- ranks that disagree on which rows need a sample (one row's prefill_len):
  the receiver kept the sampler's placeholder as a token, or dropped a real
  one; now every rank raises a DesyncError naming the row and the field;
- narrow integer dtypes in idx_mapping (int8 -1 read as 255 inside
  [0, 300)): now a BatchError before any collective, also for two rows
  (numpy's raw ValueError escaped) and int16;
- int32 token ids on the last rank were accepted, and a retried held
  broadcast (K > 0) then sent two frames for one step.
"""

from __future__ import annotations

import functools
import re
import time
from dataclasses import dataclass

import numpy as np
import pytest
import torch
import torch.distributed as dist

from ppsync.compat.vllm import PPHandler
from ppsync.core import SampledStep
from ppsync.core.path.token_path import TokenPath
from ppsync.core.rules import BatchView
from ppsync.core.wire.groups import token_group
from ppsync.errors import PPSyncError
from ppsync.harness.launcher import RankEnv, spawn_ranks
from ppsync.schemas.config import SyncConfig

TIMEOUT_S = 10.0


def _path(config: SyncConfig) -> TokenPath:
    group = token_group(dist.group.WORLD, timeout_s=config.timeout_s)  # type: ignore[arg-type]
    return TokenPath(config, group)  # the default board: the group's own store


def _view(idx: np.ndarray, prefill: list[int], computed: int = 8) -> BatchView:
    n = idx.shape[0]
    return BatchView(
        num_reqs=n,
        idx_mapping_np=idx,
        num_computed_tokens_np=np.full(n, computed, dtype=np.int64),
        num_scheduled_tokens_np=np.full(n, 4, dtype=np.int64),  # a prefill chunk of 4
        prefill_len_np=np.array(prefill, dtype=np.int64),
    )


# -- need-mask disagreement ---------------------------------------------------------

SENDER_PREFILL = [12, 12, 12]  # 8 + 4 >= 12: every row samples
# the receiver's prefill_len for row 2: 40 (it thinks the chunk is not final), or
# the sender's is 40 where the receiver's is 12
CASES = {"receiver-needs-fewer": ([12, 12, 40], SENDER_PREFILL),
         "receiver-needs-more": (SENDER_PREFILL, [12, 12, 40])}


@dataclass(frozen=True)
class Ended:
    error: str
    message: str
    expected: dict[str, int]
    received: dict[str, int]


def _need_rank(case: str, env: RankEnv) -> Ended:
    config = SyncConfig.build(pp_size=2, max_num_reqs=8, ring_depth=1, timeout_s=TIMEOUT_S)
    path = _path(config)
    mine, senders = CASES[case]
    idx = np.array([3, 5, 6], dtype=np.int64)
    try:
        for t in range(400):  # the error comes at step 1; the rest bounds the run
            if path.is_last:
                time.sleep(0.005)  # an engine's forward: the receiver reaches its check
                path.publish(_view(idx, senders), SampledStep(
                    torch.full((3, 1), 100 + t), torch.ones(3, dtype=torch.int32),
                    torch.zeros(3, dtype=torch.int32)))
            else:
                path.consume()
                path.post(_view(idx, mine))
    except PPSyncError as e:
        return Ended(type(e).__name__, str(e), getattr(e, "expected", {}),
                     getattr(e, "received", {}))
    finally:
        path.close(drain=False)
    return Ended("", "", {}, {})


@pytest.mark.parametrize("case", list(CASES))
def test_need_mask_disagreement_is_a_desync_naming_the_row_on_every_rank(case: str) -> None:
    receiver, last = spawn_ranks(functools.partial(_need_rank, case), 2, timeout_s=TIMEOUT_S)
    mine_bit, theirs_bit = (0, 1) if case == "receiver-needs-fewer" else (1, 0)
    rule = rf"need_sampled\[2\] mine {mine_bit} vs sender {theirs_bit}"
    assert receiver.error == "DesyncError", receiver
    assert re.search(rf"^rank 0: frame seq 0 row 2 disagrees with this rank's view: {rule}",
                     receiver.message), receiver.message
    assert receiver.expected["need_sampled"] == mine_bit
    assert receiver.received["need_sampled"] == theirs_bit
    # the last rank learns it from the board: the same error, the receiver's views
    assert last.error == "DesyncError", last
    assert re.search(rf"^rank 1: rank 0 reported: .*{rule}", last.message), last.message
    assert (last.expected, last.received) == (receiver.expected, receiver.received)


# -- narrow integer dtypes ------------------------------------------------------------

WIDE = 300  # max_num_reqs beyond int8's unsigned reading of -1 (255)


def _dtype_rank(env: RankEnv) -> list[str]:
    config = SyncConfig.build(pp_size=2, max_num_reqs=WIDE, ring_depth=1, timeout_s=TIMEOUT_S)
    path = _path(config)
    bad: list[np.ndarray] = [np.array([-1], dtype=np.int8), np.array([-1, 3], dtype=np.int8),
           np.array([-1], dtype=np.int16), np.array([299, -1], dtype=np.int16)]
    seen = []
    for idx in bad:
        try:
            if path.is_last:
                n = idx.shape[0]
                path.publish(_view(idx, [1] * n), SampledStep(
                    torch.full((n, 1), 7), torch.ones(n, dtype=torch.int32),
                    torch.zeros(n, dtype=torch.int32)))
            else:
                path.consume()
                path.post(_view(idx, [1] * idx.shape[0]))
        except Exception as e:  # the parent checks it is a BatchError
            seen.append(f"{type(e).__name__}: {e}")
        else:
            seen.append("accepted")
    # then a valid step: nothing was issued by the rejected calls
    good = np.array([299, 0], dtype=np.int16)
    if path.is_last:
        path.publish(_view(good, [1, 1]), SampledStep(
            torch.tensor([[41], [42]]), torch.ones(2, dtype=torch.int32),
            torch.zeros(2, dtype=torch.int32)))
    else:
        path.consume()
        path.post(_view(good, [1, 1]))
        released = path.consume()
        assert released is not None
        seen.append(repr((released.sampled_tokens[:, 0].tolist(),
                          released.idx_mapping.tolist())))
    path.close()
    return seen


def test_narrow_dtypes_are_range_checked_exactly_before_any_collective() -> None:
    receiver, last = spawn_ranks(_dtype_rank, 2, timeout_s=TIMEOUT_S)
    rows = [0, 0, 0, 1]
    for seen in (receiver, last):
        for row, s in zip(rows, seen, strict=False):
            assert re.fullmatch(
                rf"BatchError: idx_mapping\[{row}\] = -1 outside \[0, max_num_reqs = {WIDE}\)",
                s), seen
    assert receiver[-1] == repr(([41, 42], [299, 0]))


# -- int32 token ids and a retried held broadcast ---------------------------------------

K = 2


class Batch:
    """A vLLM-style input_batch of decode rows."""

    def __init__(self, idx: list[int], computed: int) -> None:
        n = len(idx)
        self.num_reqs = n
        self.idx_mapping_np = np.array(idx, dtype=np.intp)
        self.num_computed_tokens_np = np.full(n, computed, dtype=np.int64)
        self.num_scheduled_tokens = np.full(n, 1 + K, dtype=np.int32)
        self.prefill_len_np = np.full(n, 4, dtype=np.int64)


def _retry_rank(env: RankEnv) -> list[str]:
    h = PPHandler(8, K, torch.device("cpu"), timeout_s=TIMEOUT_S)
    out = []
    table = torch.full((8, K), -1, dtype=torch.int64)
    for t in range(4):
        batch = Batch([1, 4], 10 + 3 * t)
        got = h.get_prev_sampled_outputs(table)
        if h.is_last_rank:
            tokens = torch.tensor([[10 * t, 10 * t + 1, 10 * t + 2]] * 2)
            ns, nr = torch.full((2,), 3, dtype=torch.int32), torch.zeros(2, dtype=torch.int32)
            try:
                h.broadcast(tokens.to(torch.int32), ns, nr, batch)  # the engine's bug
            except PPSyncError as e:
                out.append(f"{type(e).__name__}: {e}")
            h.broadcast(tokens, ns, nr, batch)  # retried, right
            h.broadcast_drafts(torch.full((8, K), 500 + t, dtype=torch.int64), batch)
        else:
            if got is not None:
                out.append(repr(got["sampled_tokens"][:, 0].tolist()))
            h.receive(batch)
    if not h.is_last_rank:
        got = h.get_prev_sampled_outputs(table)
        assert got is not None
        out.append(repr(got["sampled_tokens"][:, 0].tolist()))
    h.close()
    return out


def test_int32_tokens_are_refused_and_a_retried_broadcast_sends_one_frame() -> None:
    receiver, last = spawn_ranks(_retry_rank, 2, timeout_s=TIMEOUT_S)
    assert last == ["BatchError: sampled_token_ids.dtype = torch.int32 must be torch.int64"] * 4
    # one frame per step, each the step's own (D = 2: steps 0..3 released at 2..4)
    assert receiver == [repr([0, 0]), repr([10, 10]), repr([20, 20])], receiver
