"""What ``vllm-check --nodes 2`` compares and prints for its served runs (no
vLLM here): one :class:`ServedRun` per handler, the same requests
(ppsync.checks.vllm.workload) sent to each over HTTP.

It passes when both runs served every request to its end, each worker
built the handler its run asked for, on every host, the token ids are
identical (a cancelled request: see the workload module), the server
counted aborted requests (the cancels reached it mid-generation), and the
hosts' traffic crossed the veth.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from ppsync.checks.vllm.report import RunResult, WorkerRecord, handler_failures, path_line
from ppsync.checks.vllm.workload import Outcome, Request

__all__ = ["ServedRun", "format_served", "served_failures", "token_mismatches"]


@dataclass(frozen=True)
class ServedRun:
    """One served engine across the hosts, to its end."""

    label: str
    expect_ppsync: bool
    workers: tuple[WorkerRecord, ...] = ()
    burst: tuple[Outcome, ...] = ()
    replays: tuple[Outcome, ...] = ()
    counters: dict[str, int] = field(default_factory=dict)  # finished by reason; "generated"
    aborted: int = 0  # requests the head logged as aborted ("Aborted request(s) ...")
    ready_s: float | None = None  # from the nodes' start to /health answering 200
    veth: tuple[int, int] | None = None  # host 0's veth bytes (sent, received) during the requests
    error: str | None = None  # why it did not serve to the end
    stop: str = ""  # how the nodes ended after the requests
    survivors: tuple[str, ...] = ()  # alive even after the namespaces' processes were killed
    logs: tuple[str, ...] = ()


def _by_id(outcomes: Sequence[Outcome]) -> dict[str, Outcome]:
    return {o.id: o for o in outcomes}


def _first_difference(a: Sequence[int], b: Sequence[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                min(len(a), len(b)))


def token_mismatches(base: ServedRun, ours: ServedRun, requests: Sequence[Request]) -> list[str]:
    """Where the two runs' answers differ, or a run's answer is not whole
    (empty: identical); the cancelled ones by the workload's rule."""
    out = []
    for run in (base, ours):
        got, again = _by_id(run.burst), _by_id(run.replays)
        for r in requests:
            o = got.get(r.id)
            if o is None or o.error is not None:
                out.append(f"{run.label}: {r.id} ({r.kind}) got no answer"
                           + (f": {o.error}" if o is not None and o.error else ""))
            elif r.cancel_after is None and (o.end != "length" or len(o.tokens) != r.max_tokens):
                out.append(f"{run.label}: {r.id} ({r.kind}) ended {o.end!r} after "
                           f"{len(o.tokens)} of {r.max_tokens} tokens")
            elif r.cancel_after is not None:
                whole = again.get(r.id)
                if whole is None or whole.error is not None or len(whole.tokens) != r.max_tokens:
                    out.append(f"{run.label}: {r.id}'s replay did not get {r.max_tokens} tokens")
                elif len(o.tokens) < r.cancel_after or whole.tokens[:len(o.tokens)] != o.tokens:
                    out.append(f"{run.label}: {r.id} ({r.kind}) got {list(o.tokens)} before its "
                               f"cancel, not the start of its replay's {list(whole.tokens[:8])}")
    for name, a_all, b_all in (("", base.burst, ours.burst), ("replay of ", base.replays,
                                                               ours.replays)):
        a, b = _by_id(a_all), _by_id(b_all)
        for r in requests:
            if r.id not in a or r.id not in b or (not name and r.cancel_after is not None):
                continue
            ta, tb = a[r.id].tokens, b[r.id].tokens
            if ta != tb:
                at = _first_difference(ta, tb)
                out.append(f"{name}{r.id} ({r.kind}): first difference at token {at} "
                           f"({list(ta[at:at + 4])} against {list(tb[at:at + 4])})")
    return out


def served_failures(base: ServedRun, ours: ServedRun, requests: Sequence[Request],
                    pp_size: int) -> list[str]:
    """Why the served check fails; empty when it passes."""
    out = [f"{run.label}: did not serve: {run.error}" for run in (base, ours) if run.error]
    for run in (base, ours):
        out += handler_failures(run_result_view(run), pp_size)
        hosts = sorted({w.node for w in run.workers})
        if len(hosts) < 2:
            out.append(f"{run.label}: workers recorded on {hosts or 'no host'}, not on both")
        if run.veth is None or min(run.veth) <= 0:
            out.append(f"{run.label}: no traffic counted on host 0's veth ({run.veth})")
        if run.survivors:
            out.append(f"{run.label}: processes survived the final kill: {run.survivors}")
        cancels = sum(r.cancel_after is not None for r in requests)
        if cancels and not run.error and run.aborted == 0:
            out.append(f"{run.label}: the head logged no aborted request after {cancels} "
                       "cancels (they did not reach the engine mid-generation)")
    if not base.error and not ours.error:
        out += token_mismatches(base, ours, requests)
    return out


def run_result_view(run: ServedRun) -> RunResult:
    """``run`` as handler_failures reads a run (label, expect_ppsync, workers)."""
    return RunResult(label=run.label, expect_ppsync=run.expect_ppsync, workers=run.workers)


def _worker_lines(run: ServedRun) -> list[str]:
    out = []
    for w in run.workers:
        mark = "ppsync" if w.ppsync else "vLLM"
        out.append(f"  {run.label}: PP rank {w.pp_rank}/{w.pp_size} on {w.node or '?'} "
                   f"(pid {w.pid}, GLOO_SOCKET_IFNAME={w.gloo_ifname or 'unset'}): "
                   f"{w.handler or 'none'} [{mark}]")
        if w.path:
            out.append(f"    ran: {path_line(w)}, token group on "
                       f"{w.path.get('token_backend', '?')}")
    return out


def _traffic_lines(run: ServedRun) -> list[str]:
    if run.veth is None:
        return [f"  {run.label}: veth counters not read"]
    sent = [w for w in run.workers if w.frames]
    frames = "".join(
        f"; ppsync's token group: PP rank {w.pp_rank} on {w.node} sent {w.frames} frames of "
        f"{w.frame_bytes} B ({w.frames * w.frame_bytes} B to each receiver)" for w in sent)
    return [f"  {run.label}: host 0's veth sent {run.veth[0]} B, received {run.veth[1]} B "
            f"during the requests{frames}"]


def _finished(counters: dict[str, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(counters.items())
                     if k != "generated" and v) or "none counted"


def format_served(base: ServedRun, ours: ServedRun, requests: Sequence[Request],
                  pp_size: int) -> str:
    """The served check's report and verdict."""
    lines = ["", "handler built in each worker (host: its namespace; its veth):"]
    for run in (base, ours):
        lines += _worker_lines(run) or [f"  {run.label}: no worker recorded a handler"]
    lines += ["", "traffic between the hosts (the only link between the namespaces is the "
              "veth pair; every gloo group binds GLOO_SOCKET_IFNAME):"]
    for run in (base, ours):
        lines += _traffic_lines(run)
    lines += ["", "requests (sent at once over HTTP with the openai client; cancelled ones: "
              "the tokens before the cancel must start the same request's whole answer, "
              "sent again after the burst, and those answers must match between handlers):"]
    a, b = _by_id(base.burst), _by_id(ours.burst)
    ra, rb = _by_id(base.replays), _by_id(ours.replays)
    for r in requests:
        oa, ob = a.get(r.id), b.get(r.id)
        got = " / ".join("-" if o is None else f"{len(o.tokens)} {o.end}" for o in (oa, ob))
        line = f"  {r.id} {r.kind}, prompt {len(r.prompt)} ids, max {r.max_tokens}: {got}"
        if r.cancel_after is not None:
            line += (f"; cancelled after {r.cancel_after}; replay "
                     + " / ".join("-" if o is None else f"{len(o.tokens)} {o.end}"
                                  for o in (ra.get(r.id), rb.get(r.id))))
        lines.append(line)
    for run in (base, ours):
        ready = "never" if run.ready_s is None else f"{run.ready_s:.0f} s"
        asked = sum(r.max_tokens for r in requests) + sum(
            r.max_tokens for r in requests if r.cancel_after is not None)
        lines.append(f"  {run.label}: ready after {ready}; the head logged {run.aborted} aborted "
                     f"request(s); the engine generated {run.counters.get('generated', '?')} "
                     f"tokens ({asked} asked for, cancels not deducted); finished requests: "
                     f"{_finished(run.counters)}; end: {run.stop or '-'}")
        lines += [f"    log: {log}" for log in run.logs]
    why = served_failures(base, ours, requests, pp_size)
    lines.append("")
    if why:
        lines += ["FAIL", *(f"  {w}" for w in why)]
    else:
        n = sum(len(o.tokens) for o in ours.burst) + sum(len(o.tokens) for o in ours.replays)
        lines.append(f"PASS: served over HTTP across 2 hosts at PP {pp_size}: ppsync's handler in "
                     f"all {pp_size} workers, {len(requests)} concurrent requests (streamed, "
                     f"cancelled, greedy, seeded) and {len(ours.replays)} replays, {n} token ids "
                     "identical to vLLM's own handler's; the token group's traffic crossed the "
                     "veth")
    return "\n".join(lines)
