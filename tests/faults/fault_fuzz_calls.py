"""What the two rank fuzzers (test_fault_fuzz_token_path.py,
test_fault_fuzz_vllm.py) share: their world, round r's valid step, the bad
values of a step's rows and outputs, a bad call, what it did, the rules every
bad call is held to, and the check that both ranks generated one schedule.

The world: P = 2 (rank 0 receives, rank 1 is the last rank), D = 1, K = 2.
Round r's valid step has three decode rows in request slots ``slots(r)``, each
needing a sample; row i samples NUM_SAMPLED[i] tokens.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from fault_fuzz_inputs import Bad, bad_int, fingerprint, int_tensor, view_bads
from hypothesis import strategies as st

from ppsync.core.path.token_path import TokenPath
from ppsync.errors import PPSyncError
from ppsync.harness.launcher import RankEnv

MAX_NUM_REQS = 8
K = 2  # speculative steps
L = K + 1  # the most tokens a row samples in one step
TIMEOUT_S = 10.0
RECEIVER, LAST = 0, 1

# -- valid values ---------------------------------------------------------------------

NUM_SAMPLED = [1, 2, 3]
NUM_REJECTED = [2, 1, 0]
COMPUTED, SCHEDULED, PREFILL_LEN = 10, 1 + K, 5  # every row of a valid step: decode
BASE_IDX = [2, 5, 7]  # the request slots of every bad call's otherwise valid step
BASE_R = 10_000  # the round whose tokens bad calls carry (any valid values do)


def slots(r: int) -> list[int]:
    """Round r's request slots."""
    return [r % MAX_NUM_REQS, (r + 3) % MAX_NUM_REQS, (r + 5) % MAX_NUM_REQS]


def tokens(r: int) -> torch.Tensor:  # [3, L] int64, -1 past num_sampled
    rows, cols = np.meshgrid(np.arange(3), np.arange(L), indexing="ij")
    out = 1000 * r + 10 * rows + cols
    return torch.from_numpy(np.where(cols < np.array(NUM_SAMPLED)[:, None], out, -1))


def drafts(r: int) -> np.ndarray:  # [3, K] int64, the drafts of round r's rows
    rows, cols = np.meshgrid(np.arange(3), np.arange(K), indexing="ij")
    out: np.ndarray = 500_000 + 1000 * r + 10 * rows + cols
    return out


def outputs(r: int) -> dict[str, object]:
    """The sampler's outputs of round r, as the engine passes them."""
    return {
        "sampled_token_ids": tokens(r),
        "num_sampled": torch.tensor(NUM_SAMPLED, dtype=torch.int32),
        "num_rejected": torch.tensor(NUM_REJECTED, dtype=torch.int32),
    }


# -- bad values -------------------------------------------------------------------------

# by BatchView attribute (vLLM's input batch calls num_scheduled_tokens_np
# num_scheduled_tokens)
VIEW_BAD = view_bads(3, np.array(BASE_IDX, dtype=np.int64), {
    "num_computed_tokens_np": np.full(3, COMPUTED, dtype=np.int64),
    "num_scheduled_tokens_np": np.full(3, SCHEDULED, dtype=np.int64),
    "prefill_len_np": np.full(3, PREFILL_LEN, dtype=np.int64),
}, MAX_NUM_REQS)
OUTPUT_BAD: dict[str, st.SearchStrategy[Bad]] = {
    "sampled_token_ids": int_tensor("sampled_token_ids", tokens(BASE_R),
                                    bad_widths=[0, L + 1, L + 4]),
    "num_sampled": int_tensor("num_sampled", torch.tensor(NUM_SAMPLED), lo=0, hi=L),
    "num_rejected": int_tensor("num_rejected", torch.tensor(NUM_REJECTED), lo=0, hi=K),
}
FREE_BAD = bad_int("req_idx", 0, MAX_NUM_REQS)

# -- bad calls and what they did ----------------------------------------------------------


@dataclass(frozen=True)
class BadCall:
    """One bad call: who makes it, where in the round (``when``, a hook of the
    rank loop), into which method (``entry``), with which argument or batch
    attribute (``arg``; "" for role and order errors) replaced by
    ``bad.value``, and the PPSyncError subclass it must raise."""

    rank: int
    when: str
    entry: str
    arg: str
    error: str
    bad: Bad

    def describe(self) -> str:
        return f"rank {self.rank} {self.when} {self.entry}({self.arg}) {self.bad.describe()}"


def calls(bads: st.SearchStrategy[Bad], rank: int, when: str, entry: str, arg: str,
          error: str) -> st.SearchStrategy[BadCall]:
    """A bad call of ``entry`` for each value of ``bads``."""
    return bads.map(functools.partial(BadCall, rank, when, entry, arg, error))


State = tuple[int, ...]  # what a bad call must leave as it was


def path_state(path: TokenPath) -> State:
    """(seq, steps, steps in the ring, works in flight) of ``path``."""
    return (path.seq, path.steps, len(list(path.ring.pending())),
            len(path._inflight))


@dataclass(frozen=True)
class Attempt:
    """A bad call and what it did, for the parent to check."""

    call: str  # BadCall.describe()
    entry: str
    arg: str
    kind: str
    label: str
    field: str  # what the message must name
    expected: str  # the error type's name
    error: str  # the raised type's name, "" when nothing was raised
    is_ppsync: bool  # whether it was a PPSyncError
    message: str
    before: State | None  # None: no state to keep (a constructor call)
    after: State | None


def attempt(call: BadCall, make: Callable[[], object],
            state: Callable[[], State] | None = None) -> Attempt:
    """Run ``make`` (``call``, made) and record what it did."""
    before = None if state is None else state()
    error, is_ppsync, message = "", False, ""
    try:
        make()
    except Exception as e:  # recorded; the parent checks type and message
        error, is_ppsync, message = type(e).__name__, isinstance(e, PPSyncError), str(e)
    return Attempt(call.describe(), call.entry, call.arg, call.bad.kind, call.bad.label,
                   call.bad.field, call.error, error, is_ppsync, message, before,
                   None if state is None else state())


def problems(a: Attempt) -> list[str]:
    """The rules ``a`` broke: raise the expected PPSyncError subclass, name the
    field (or the call) in its message, change no state."""
    out = []
    if not a.is_ppsync or a.error != a.expected:
        out.append(f"raised {a.error or 'nothing'}, not {a.expected}")
    if a.field not in a.message:
        out.append(f"message does not name {a.field!r}")
    if a.after != a.before:
        out.append(f"state {a.before} -> {a.after}")
    return out


def report(attempts: Sequence[Attempt]) -> list[str]:
    """One line per attempt that broke a rule."""
    return [f"{a.call}: {'; '.join(p)} [{a.error}: {a.message}]"
            for a in attempts if (p := problems(a))]


def agree(env: RankEnv, what: str, schedule: Sequence[BadCall]) -> None:
    """Both ranks generated the same schedule, or stop here."""
    mine = fingerprint([c.describe() for c in schedule] + [repr(c.bad.value) for c in schedule])
    env.store.set(f"fuzz/{what}/{env.rank}", mine)
    if env.store.get(f"fuzz/{what}/{1 - env.rank}").decode() != mine:
        raise AssertionError(f"rank {env.rank}: hypothesis generated another {what} schedule "
                             "than the peer rank; the rounds would not match")
