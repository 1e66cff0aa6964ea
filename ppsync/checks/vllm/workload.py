"""What ``vllm-check --nodes 2`` asks the served engine over HTTP, and what
came back (no vLLM, no HTTP here: ppsync.checks.vllm.http_client
sends it).

The burst: requests sent at once, cycling through six kinds: plain greedy,
streamed greedy, streamed greedy cancelled by the client after 2-5
tokens, plain seeded, streamed seeded, streamed seeded cancelled. Greedy
is temperature 0; seeded is temperature 0.8 with a seed of its own per
request (vLLM then samples each request from its own generator, so the
tokens do not depend on which requests share a batch). A cancelled request
asks for 48 tokens and leaves after a few, so the server aborts it while
the other requests still decode: its request slot is freed, and reused,
with frames in flight (the generation counters' test).

How cancelled requests are compared (decided here, said in the report):
each is sent again, whole, after the burst (a replay); the tokens it got
before its cancel must be the start of its replay's, in each run, and the
replays must be identical between the two handlers like every other
request. So a cancel is checked for what it got (a prefix of the
uncancelled answer) and for what it left behind (the engine's later
answers).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

__all__ = ["KINDS", "Outcome", "Request", "fault_requests", "outcomes", "served_requests"]

KINDS = ("plain greedy", "stream greedy", "cancel greedy", "plain seeded", "stream seeded",
         "cancel seeded")
CANCEL_MAX_TOKENS = 48
FAULT_MAX_TOKENS = 100


@dataclass(frozen=True)
class Request:
    """One completion request."""

    id: str
    prompt: tuple[int, ...]  # token ids
    max_tokens: int
    stream: bool
    temperature: float
    seed: int | None = None
    cancel_after: int | None = None  # the client closes its stream after this many tokens

    @property
    def kind(self) -> str:
        how = "cancel" if self.cancel_after is not None else "stream" if self.stream else "plain"
        return f"{how} {'seeded' if self.seed is not None else 'greedy'}"

    def as_json(self) -> dict[str, Any]:
        return {"id": self.id, "prompt": list(self.prompt), "max_tokens": self.max_tokens,
                "stream": self.stream, "temperature": self.temperature, "seed": self.seed,
                "cancel_after": self.cancel_after}


def _prompt(rng: random.Random, vocab: int) -> tuple[int, ...]:
    return tuple(rng.randrange(3, vocab) for _ in range(rng.randrange(4, 16)))


def served_requests(seed: int, n: int, vocab: int = 512) -> list[Request]:
    """The burst: ``n`` requests cycling through :data:`KINDS` (ids 3 and up:
    below are the model's special tokens)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        kind = KINDS[i % len(KINDS)]
        seeded = kind.endswith("seeded")
        cancel = rng.randrange(2, 6) if kind.startswith("cancel") else None
        out.append(Request(
            id=f"r{i}", prompt=_prompt(rng, vocab),
            max_tokens=CANCEL_MAX_TOKENS if cancel else rng.randrange(8, 25),
            stream=not kind.startswith("plain"), temperature=0.8 if seeded else 0.0,
            seed=1000 + i if seeded else None, cancel_after=cancel))
    return out


def fault_requests(seed: int, n: int = 4, vocab: int = 512) -> list[Request]:
    """A fault run's requests: ``n`` long greedy streams, under way when the
    fault comes."""
    rng = random.Random(seed)
    return [Request(id=f"f{i}", prompt=_prompt(rng, vocab), max_tokens=FAULT_MAX_TOKENS,
                    stream=True, temperature=0.0) for i in range(n)]


@dataclass(frozen=True)
class Outcome:
    """How one request ended, as the client saw it."""

    id: str
    tokens: tuple[int, ...]
    end: str  # "length", "cancelled", "error", ...
    error: str | None = None  # "type: first line"
    t0: float = 0.0  # time.time() it was sent
    t1: float = 0.0  # and ended


def outcomes(raw: object) -> tuple[Outcome, ...]:
    """Outcomes from the client's JSON list (anything else: none)."""
    if not isinstance(raw, list):
        return ()
    out = []
    for r in raw:
        err = r.get("error")
        out.append(Outcome(id=str(r["id"]), tokens=tuple(int(t) for t in r.get("tokens", ())),
                           end=str(r.get("end", "?")),
                           error=None if not err else f"{err['type']}: {err['line']}",
                           t0=float(r.get("t0", 0.0)), t1=float(r.get("t1", 0.0))))
    return tuple(out)
