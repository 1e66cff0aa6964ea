"""The synthetic workload (docs/design.md §6): a deterministic scheduler that every
rank runs from one seed.

Requests arrive, prefill in chunks, decode (accepting or rejecting speculative
tokens when K > 0), finish by length, get aborted or preempted; their request
slots are reused at once (lowest free slot first), often within D steps.
Requests live in D lanes (lane = request id mod D) and are scheduled only on
their lane's steps, so a request is never in two steps that are in flight
together: the microbatching a PP engine does.

Every value the last rank "samples" is a pure function of (request, position),
so every rank can check each delivered row exactly (``ppsync.harness.checker``).
The workload's own rule for which rows sample is written independently of
``ppsync.core.rules.mask`` so that each checks the other.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from ppsync.core.rules import BatchView

_M64 = np.uint64(0xFFFFFFFFFFFFFFFF)


def oracle(req_ids: np.ndarray, positions: np.ndarray, salt: int = 0) -> np.ndarray:
    """Token id (in [0, 2^31)) of request ``req_ids`` at ``positions``."""
    with np.errstate(over="ignore"):
        x = (req_ids.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)
             + positions.astype(np.uint64) * np.uint64(0xBF58476D1CE4E5B9)
             + np.uint64(salt) * np.uint64(0x94D049BB133111EB)) & _M64
        x ^= x >> np.uint64(31)
        x = (x * np.uint64(0xD6E8FEB86659FD93)) & _M64
        x ^= x >> np.uint64(32)
    return (x & np.uint64(0x7FFFFFFF)).astype(np.int64)


SALT_ACCEPT = 1
SALT_DRAFT = 2


@dataclass(frozen=True, slots=True)
class WorkloadConfig:
    """Knobs of the synthetic workload; every rank must use the same."""

    max_num_reqs: int
    num_speculative_steps: int = 0
    ring_depth: int = 1
    seed: int = 0
    steps: int = 1000
    arrival_p: float = 0.5  # chance per step that requests arrive
    max_arrivals: int = 4
    prompt_len: tuple[int, int] = (1, 40)
    max_tokens: tuple[int, int] = (1, 24)
    chunk: tuple[int, int] = (4, 16)  # prefill tokens per step
    abort_p: float = 0.01  # per live request per step
    preempt_p: float = 0.005  # per live request not in flight, per step
    idle_every: int = 97  # every so many steps, arrivals pause for a while
    use_max_seq_len: bool = True


@dataclass(slots=True)
class Request:
    req_id: int
    slot: int
    prompt_len: int
    max_tokens: int
    prefill_len: int  # tokens to compute before the next sample
    num_computed: int = 0
    num_tokens: int = 0  # prompt + outputs so far
    in_flight: bool = False

    @property
    def outputs(self) -> int:
        return self.num_tokens - self.prompt_len

    @property
    def max_seq_len(self) -> int:
        return self.prompt_len + self.max_tokens


@dataclass(frozen=True, slots=True)
class ScheduledStep:
    """One step: the batch view every rank builds, and what the last rank
    samples for it."""

    step: int
    view: BatchView
    req_ids_np: np.ndarray  # [num_reqs] int64
    positions_np: np.ndarray  # [num_reqs] int64: position of each row's first sampled token
    need_np: np.ndarray  # [num_reqs] bool: the workload's own need-sampled rule
    tokens_np: np.ndarray  # [num_reqs, L] int64, -1 past num_sampled
    width: int  # w: token columns the last rank sends (1..L)
    num_sampled_np: np.ndarray  # [num_reqs] int32
    num_rejected_np: np.ndarray  # [num_reqs] int32
    drafts_np: np.ndarray | None  # [num_reqs, K] int64, None when K = 0
    seq: int  # frame sequence number, -1 when the step has no transfer

    @property
    def num_reqs(self) -> int:
        return self.view.num_reqs


@dataclass(slots=True)
class Workload:
    """The replicated scheduler. Per step t, every rank calls
    :meth:`begin_step` (returns the request slots to free) then
    :meth:`schedule`."""

    cfg: WorkloadConfig
    live: dict[int, Request] = field(default_factory=dict)  # slot -> request
    waiting: list[Request] = field(default_factory=list)
    history: dict[int, ScheduledStep] = field(default_factory=dict)
    freed_at: dict[int, int] = field(default_factory=dict)  # req_id -> step freed
    retired: list[int] = field(default_factory=list)  # req_ids gone for good, D steps ago
    _freed_log: deque[tuple[int, int, bool]] = field(default_factory=deque)  # (step, id, final)
    _free_slots: list[int] = field(default_factory=list)
    _next_req: int = 0
    _seq: int = 0

    def __post_init__(self) -> None:
        self._free_slots = list(range(self.cfg.max_num_reqs))
        heapq.heapify(self._free_slots)

    @property
    def depth(self) -> int:
        return self.cfg.ring_depth

    def _rng(self, t: int, what: int) -> np.random.Generator:
        return np.random.default_rng([self.cfg.seed, t, what])

    def _free(self, req: Request, t: int, *, final: bool = True) -> int:
        del self.live[req.slot]
        heapq.heappush(self._free_slots, req.slot)
        self.freed_at[req.req_id] = t
        self._freed_log.append((t, req.req_id, final))
        return req.slot

    def _retire(self, t: int) -> None:
        """Forget requests freed more than D steps ago (no step in flight can
        still name them), so a long run's memory stays flat."""
        self.retired.clear()
        log = self._freed_log
        while log and log[0][0] < t - self.depth:
            step, req_id, final = log.popleft()
            if self.freed_at.get(req_id) == step:
                del self.freed_at[req_id]
                if final:
                    self.retired.append(req_id)

    def begin_step(self, t: int) -> list[int]:
        """Apply step t-D's samples, then finishes, aborts, preemptions and
        arrivals. Returns the request slots freed, in order."""
        freed: list[int] = []
        self._retire(t)
        done = self.history.pop(t - self.depth, None)
        if done is not None:
            self._apply(done, t, freed)
        rng = self._rng(t, 0)
        for slot in sorted(self.live):
            req = self.live[slot]
            u = rng.random()
            if u < self.cfg.abort_p:
                freed.append(self._free(req, t))
            elif u < self.cfg.abort_p + self.cfg.preempt_p and not req.in_flight:
                freed.append(self._free(req, t, final=False))
                req.prefill_len, req.num_computed = req.num_tokens, 0
                self.waiting.append(req)
        if t < self.cfg.steps:
            self._arrive(t, rng)
        while self.waiting and self._free_slots:
            req = self.waiting.pop(0)
            req.slot = heapq.heappop(self._free_slots)
            self.live[req.slot] = req
        return freed

    def _apply(self, done: ScheduledStep, t: int, freed: list[int]) -> None:
        K = self.cfg.num_speculative_steps
        for row in range(done.num_reqs):
            req = self.live.get(int(done.view.idx_mapping_np[row]))
            if req is None or req.req_id != int(done.req_ids_np[row]):
                continue  # freed while in flight: its sample is stale
            req.in_flight = False
            scheduled = int(done.view.num_scheduled_tokens_np[row])
            if not done.need_np[row] and req.num_computed + scheduled < req.prefill_len:
                req.num_computed += scheduled  # a non-final prefill chunk
                continue
            ns = int(done.num_sampled_np[row])
            req.num_computed += scheduled - (int(done.num_rejected_np[row]) if K else 0)
            req.num_tokens += ns
            if req.outputs >= req.max_tokens:
                freed.append(self._free(req, t))

    def _arrive(self, t: int, rng: np.random.Generator) -> None:
        cfg = self.cfg
        if (t // cfg.idle_every) % 5 == 4 or rng.random() >= cfg.arrival_p:
            return
        for _ in range(int(rng.integers(1, cfg.max_arrivals + 1))):
            if len(self.live) + len(self.waiting) >= cfg.max_num_reqs + cfg.max_arrivals:
                return
            prompt = int(rng.integers(cfg.prompt_len[0], cfg.prompt_len[1] + 1))
            req = Request(
                req_id=self._next_req, slot=-1, prompt_len=prompt,
                max_tokens=int(rng.integers(cfg.max_tokens[0], cfg.max_tokens[1] + 1)),
                prefill_len=prompt, num_tokens=prompt,
            )
            self._next_req += 1
            self.waiting.append(req)

    def schedule(self, t: int) -> ScheduledStep:
        """Build step t's batch from the requests of lane t mod D."""
        cfg = self.cfg
        K, L = cfg.num_speculative_steps, cfg.num_speculative_steps + 1
        rng = self._rng(t, 1)
        lane = t % self.depth
        reqs = [] if t >= cfg.steps else [
            r for s, r in sorted(self.live.items())
            if r.req_id % self.depth == lane and not r.in_flight
        ]
        rng.shuffle(reqs)
        n = len(reqs)
        req_ids = np.array([r.req_id for r in reqs], dtype=np.int64)
        slots = np.array([r.slot for r in reqs], dtype=np.int64)
        computed = np.array([r.num_computed for r in reqs], dtype=np.int64)
        prefill = np.array([r.prefill_len for r in reqs], dtype=np.int64)
        max_seq = np.array([r.max_seq_len for r in reqs], dtype=np.int64)
        chunks = rng.integers(cfg.chunk[0], cfg.chunk[1] + 1, size=n)
        in_prefill = computed < prefill
        scheduled = np.where(in_prefill, np.minimum(chunks, prefill - computed), 1 + K)
        need = (computed + scheduled >= prefill) & ~(in_prefill & (prefill + 1 >= max_seq))
        positions = np.array([r.num_tokens for r in reqs], dtype=np.int64)
        remaining = np.array([r.max_tokens - r.outputs for r in reqs], dtype=np.int64)
        accepted = oracle(req_ids, positions, SALT_ACCEPT) % L if n else np.zeros(0, np.int64)
        accepted = np.where(in_prefill, 0, np.minimum(accepted, remaining - 1))
        num_sampled = np.where(need | (computed + scheduled >= prefill), accepted + 1, 0)
        num_rejected = np.where(in_prefill | (num_sampled == 0), 0, K - accepted)
        cols = np.arange(L)
        tokens = oracle(req_ids[:, None], positions[:, None] + cols[None, :]) if n else (
            np.zeros((0, L), np.int64))
        tokens = np.where(cols[None, :] < num_sampled[:, None], tokens, -1)
        width = int(max(1, int(num_sampled.max()) if n else 1))
        drafts = None
        if K:
            after = positions + num_sampled
            drafts = oracle(req_ids[:, None], after[:, None] + np.arange(K)[None, :], SALT_DRAFT) \
                if n else np.zeros((0, K), np.int64)
        view = BatchView(
            num_reqs=n,
            idx_mapping_np=slots,
            num_computed_tokens_np=computed,
            num_scheduled_tokens_np=scheduled.astype(np.int64),
            prefill_len_np=prefill,
            max_seq_len_np=max_seq if cfg.use_max_seq_len else None,
            is_prefilling_np=in_prefill if cfg.use_max_seq_len else None,
        )
        if not cfg.use_max_seq_len:
            need = computed + scheduled >= prefill
        seq = -1
        if need.any():
            seq, self._seq = self._seq, self._seq + 1
        for r in reqs:
            r.in_flight = True
        step = ScheduledStep(
            step=t, view=view, req_ids_np=req_ids, positions_np=positions, need_np=need,
            tokens_np=tokens, width=width, num_sampled_np=num_sampled.astype(np.int32),
            num_rejected_np=num_rejected.astype(np.int32), drafts_np=drafts, seq=seq,
        )
        self.history[t] = step
        return step
