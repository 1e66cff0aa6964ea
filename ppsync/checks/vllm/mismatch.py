"""``vllm-check --nodes 2 --mismatch switch|codec|timeout``: host 1 does not
run what host 0 runs, and the engine must not serve.

- ``switch``: host 1 without ``PPSYNC_VLLM=1`` (vLLM's own handler there),
  host 0 with it;
- ``codec``: ``PPSYNC_CODEC=host`` on host 0, ``device`` on host 1;
- ``timeout``: ``PPSYNC_TIMEOUT_S`` T on host 0, T + 10 on host 1.

Every ppsync worker must refuse, in one line naming a rank of the other
host and what differs, within its start-up bound (its ``timeout_s`` +
SLACK_S from when its model runner began to be built;
ppsync.compat.vllm.agreement), and the engine must serve no token (the
client never sees ``/health`` answer, or gets no tokens). The check then
reports how the engine ended on each host and kills what is left.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass
from pathlib import Path

from ppsync.checks.vllm.faults import SLACK_S
from ppsync.checks.vllm.node_faults import GRACE_S
from ppsync.checks.vllm.served import (
    NodePlan,
    NodesOptions,
    NodesRun,
    client_spec,
    end_client,
)
from ppsync.checks.vllm.workload import outcomes, served_requests
from ppsync.compat.vllm.settings import ENV_CODEC, ENV_TIMEOUT, settings_from_env

__all__ = ["MISMATCHES", "MismatchOutcome", "Refusal", "format_mismatch", "mismatch_failures",
           "plans_for", "read_refusals", "run_mismatch"]

MISMATCHES = ("switch", "codec", "timeout")
HOW = {"switch": "did not announce", "codec": ENV_CODEC, "timeout": ENV_TIMEOUT}
"""What a refusal line must say for each case."""
RANK = re.compile(r"PP rank (\d+) \(global rank \d+")
WATCH_AFTER_S = 60.0  # after the refusal bound: vLLM's own teardown


def plans_for(case: str, timeout_s: float) -> tuple[NodePlan, NodePlan]:
    """Host 0's and host 1's settings for ``case``."""
    if case == "switch":
        return NodePlan(True), NodePlan(False)
    if case == "codec":
        return NodePlan(True, ((ENV_CODEC, "host"),)), NodePlan(True, ((ENV_CODEC, "device"),))
    if case == "timeout":
        return (NodePlan(True, ((ENV_TIMEOUT, f"{timeout_s:g}"),)),
                NodePlan(True, ((ENV_TIMEOUT, f"{timeout_s + 10:g}"),)))
    raise ValueError(f"mismatch {case!r}: one of {', '.join(MISMATCHES)}")


@dataclass(frozen=True)
class Refusal:
    """A worker whose model runner raised while being built."""

    node: str
    pp_rank: int | None
    seconds: float  # from the start of its model runner's construction
    type: str
    line: str


def read_refusals(record_dir: Path) -> tuple[Refusal, ...]:
    """The ``init-error-*.jsonl`` records the worker hooks wrote."""
    out = []
    for path in sorted(record_dir.glob("init-error-*.jsonl")):
        for line in path.read_text().splitlines():
            try:
                e = json.loads(line)
            except json.JSONDecodeError:
                continue
            out.append(Refusal(node=str(e.get("node", "?")), pp_rank=e.get("pp_rank"),
                               seconds=float(e["t"]) - float(e["t0"]), type=str(e["type"]),
                               line=str(e["line"])))
    return tuple(sorted(out, key=lambda r: (r.node, r.pp_rank or 0)))


@dataclass(frozen=True)
class MismatchOutcome:
    """How the engine with mismatched hosts ended."""

    case: str
    plans: tuple[NodePlan, NodePlan]
    labels: tuple[str, str]  # each host's label, as the workers record it
    per_node: int  # PP stages per host
    bounds: tuple[float, float]  # each host's timeout_s
    refusals: tuple[Refusal, ...] = ()
    served_tokens: int = 0
    ready: bool = False
    head_ended_s: float | None = None  # from the start; None: up at the watch's end
    left: tuple[str, ...] = ()  # live GRACE_S after the head ended (or at the watch's end)
    survivors: tuple[str, ...] = ()


def mismatch_failures(o: MismatchOutcome) -> list[str]:
    """Why the refusal did not hold; empty when it did."""
    out = []
    if o.ready or o.served_tokens:
        out.append(f"{o.case}: the engine served ({o.served_tokens} tokens; /health "
                   f"{'answered' if o.ready else 'never answered'})")
    for node, plan in enumerate(o.plans):
        if not plan.ppsync:
            continue
        mine = [r for r in o.refusals if r.node == o.labels[node]]
        if len(mine) != o.per_node:
            out.append(f"{o.case}: {len(mine)} refusal(s) on {o.labels[node]}, which runs "
                       f"{o.per_node} ppsync worker(s)")
        other = set(range(o.per_node)) if node else set(range(o.per_node, 2 * o.per_node))
        for r in mine:
            named = {int(m) for m in RANK.findall(r.line)} - {r.pp_rank}
            if "refuses to serve" not in r.line or not named & other:
                out.append(f"{o.case}: PP rank {r.pp_rank} on {r.node} did not refuse naming a "
                           f"rank of the other host: {r.line[:200]}")
            elif HOW[o.case] not in r.line:
                out.append(f"{o.case}: PP rank {r.pp_rank}'s refusal does not say "
                           f"{HOW[o.case]!r}: {r.line[:200]}")
            if r.seconds > o.bounds[node] + SLACK_S:
                out.append(f"{o.case}: PP rank {r.pp_rank} refused {r.seconds:.1f} s after its "
                           f"start (bound {o.bounds[node]:g} + {SLACK_S:g} s)")
    if o.survivors:
        out.append(f"{o.case}: survived the final kill: {list(o.survivors)}")
    return out


def format_mismatch(o: MismatchOutcome) -> str:
    lines = ["", f"mismatch {o.case}: host 0 {o.plans[0].describe()}; host 1 "
             f"{o.plans[1].describe()}"]
    for r in o.refusals:
        lines.append(f"  {r.node} PP rank {r.pp_rank}, {r.seconds:.1f} s after its model runner "
                     f"began: {r.type}: {r.line}")
    if not o.refusals:
        lines.append("  no worker refused")
    health = "answered" if o.ready else "never answered"
    head = ("still up when the watch ended" if o.head_ended_s is None
            else f"ended {o.head_ended_s:.0f} s after the start")
    lines.append(f"  served: {o.served_tokens} tokens; /health {health}")
    lines.append(f"  head process: {head}; live {GRACE_S:g} s later: {len(o.left)} "
                 f"({', '.join(o.left[:6])}); after the final kill: {len(o.survivors)}")
    why = mismatch_failures(o)
    lines.append("")
    lines += (["FAIL", *(f"  {w}" for w in why)] if why else [
        f"PASS: mismatch {o.case}: every ppsync worker refused in one line naming a rank of the "
        "other host, within its start-up bound; no token served"])
    return "\n".join(lines)


def run_mismatch(nodes: NodesOptions, case: str) -> int:
    """One engine with ``case``'s hosts; exit 1 unless every ppsync worker refused."""
    timeout_s = settings_from_env(nodes.env).timeout_s
    plans = plans_for(case, timeout_s)
    bounds = tuple(settings_from_env({**nodes.env, **dict(p.env)}).timeout_s for p in plans)
    run_dir = nodes.work / f"run-mismatch-{case}"
    print(f"  one run (mismatch {case}: host 0 {plans[0].describe()}; host 1 "
          f"{plans[1].describe()}) ...", flush=True)
    watch_s = nodes.timeout_s / 3 + max(bounds) + WATCH_AFTER_S
    with NodesRun(run_dir, nodes.spec, plans, nodes.env) as run:
        run.start()
        t0 = time.time()
        client = run.client(client_spec(run, served_requests(nodes.seed, 2),
                                        ready_timeout_s=watch_s, request_timeout_s=60.0))
        head = run.nodes[0]
        run.wait(lambda: head.poll() is not None or client.poll() is not None, watch_s)
        head_s = None if head.poll() is None else time.time() - t0
        end_client(client)  # the check's own process on host 0, not the engine's
        if head_s is not None:  # what the engine leaves once its head ended
            time.sleep(GRACE_S)
        left = tuple(run.left())
        labels = (run.label(0), run.label(1))
    result = run.client_result()
    served = sum(len(o.tokens) for o in outcomes(result.get("burst")))
    outcome = MismatchOutcome(
        case=case, plans=plans, labels=labels, per_node=nodes.spec.pp_size // 2,
        bounds=(bounds[0], bounds[1]), refusals=read_refusals(run_dir / "records"),
        served_tokens=served, ready=result.get("ready_s") is not None, head_ended_s=head_s,
        left=left, survivors=tuple(run.survivors))
    print(format_mismatch(outcome), flush=True)
    return 1 if mismatch_failures(outcome) else 0
