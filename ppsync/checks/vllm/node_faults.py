"""``vllm-check --nodes 2 --fault kill-node|stop-node|cut-link``: host 1 fails
while the HTTP client streams, once with vLLM's own handler on both hosts
and once with ppsync's; how each engine ended, side by side.

Once every stream of the client (ppsync.checks.vllm.http_client)
has its first tokens, the check SIGKILLs every process of host 1
(``kill-node``: a host that died), SIGSTOPs them (``stop-node``: a host
frozen, e.g. swapping or paused), or takes host 1's veth down (``cut-link``:
a cable or switch port gone; nothing is reset, packets vanish). Then it
watches, up to ``--fault-bound`` s: what the client got (an error, and
when; or nothing until its own timeout: a hang), which PP rank and host a
ppsync worker named in its log (the plugin's one line, with the host each
rank announced at start-up, ppsync.compat.vllm.agreement), when host 0's
head process ended, and what was still running on each host
:data:`GRACE_S` later. Then everything is killed and both hosts deleted.

ppsync's run passes when a ppsync worker named a PP rank of host 1, with
host 1's address, within its bound (:func:`detection_bound_s` + SLACK_S
of the fault), the client got an error (not its own timeout) within that
plus vLLM's own teardown, the head ended and left nothing on host 0, and
nothing survived the final kill. vLLM's run is reported, not judged.

vLLM's own teardown across hosts: the head's executor sees its local
worker leave at once, but its engine core is then waiting for the step's
result from the last PP rank, on host 1, and stops waiting only at
``VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS`` (300 s by default) before it fails
the requests. The check sets it to :data:`EXECUTE_TIMEOUT_S` for both
handlers' fault runs (unless the environment sets it) and allows that
plus :data:`TEARDOWN_SLACK_S`.
"""

from __future__ import annotations

import re
import signal
import time
from dataclasses import dataclass, replace

from ppsync.checks.vllm.faults import SLACK_S
from ppsync.checks.vllm.report import read_worker_records
from ppsync.checks.vllm.served import (
    NodePlan,
    NodesOptions,
    NodesRun,
    client_spec,
    end_client,
)
from ppsync.checks.vllm.workload import Outcome, fault_requests, outcomes
from ppsync.compat.vllm.settings import PluginSettings, settings_from_env

__all__ = ["EXECUTE_TIMEOUT_S", "GRACE_S", "NODE_FAULTS", "NodeFaultOutcome", "detection_bound_s",
           "format_node_faults", "node_fault_failures", "ppsync_named", "run_node_fault"]

NODE_FAULTS = ("kill-node", "stop-node", "cut-link")
GRACE_S = 5.0
EXECUTE_ENV = "VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS"
EXECUTE_TIMEOUT_S = 60
"""vLLM's bound on one step's result in the check's fault runs (its default: 300)."""
TEARDOWN_SLACK_S = 30.0
"""vLLM's teardown beyond its execute timeout: the engine core fails, the
API server fails the streams and exits."""
MARKER_TOKENS = 3
LEFT_WORKER = re.compile(
    r"ppsync: (PP rank \d+ \(global rank \d+(?:, host [^,]+, pid \d+)?\)): (.+?) raised "
    r"(\w+): (.*?)(?: \[the rank named: PP rank (\d+) \(global rank \d+, host ([^,]+), "
    r"pid \d+\)\])?; this worker exits")
VLLM_ERROR = re.compile(r"^(\(\w+ pid=\d+\)) ERROR [^\]]*\] (\w*(?:Error|Exception)\b.*|"
                        r"Worker proc \S+ died unexpectedly.*)$", re.MULTILINE)
"""vLLM's log line naming an error: its process, then the error's type and text."""


def detection_bound_s(settings: PluginSettings) -> float:
    """How long ppsync may take to name the host's stage: a stopped or cut
    off one within ``silent_s`` + 1 s (its heartbeat stopped); a dead one at
    once where a transfer with it is pending (a connection error), else as
    a stopped one (its heartbeat stopped too)."""
    return settings.silent_s + 1.0


@dataclass(frozen=True)
class NodeFaultOutcome:
    """How one served engine ended after host 1's fault."""

    label: str
    expect_ppsync: bool
    fault: str
    host1_ranks: tuple[int, ...]
    host1_addr: str
    fault_t: float | None  # None: the streams never got going
    streams: tuple[Outcome, ...] = ()
    after: tuple[Outcome, ...] = ()  # a new request sent once the streams ended
    named: tuple[int, str, float] | None = None  # ppsync: (PP rank, host, s after the fault)
    named_line: str = ""  # the ppsync worker's line, or vLLM's first error line
    head_ended_s: float | None = None  # None: still up at the bound
    left: tuple[str, ...] = ()  # live GRACE_S after the head ended (or at the bound)
    survivors: tuple[str, ...] = ()
    bound_s: float = 0.0
    error: str | None = None  # the run did not get to its fault

    def client_error_s(self) -> tuple[str, float] | None:
        """The first error a stream got that is not the client's own timeout."""
        errs = sorted((o.t1, o.error) for o in self.streams if o.error and "Timeout" not in
                      o.error.split(":")[0])
        if not errs or self.fault_t is None:
            return None
        return str(errs[0][1]), errs[0][0] - self.fault_t


def ppsync_named(log: str) -> list[tuple[str, str, str, str, int | None, str | None]]:
    """The plugin's lines of workers that left on an error: (who, call,
    type, first line, the PP rank named, its host)."""
    return [(m[1], m[2], m[3], m[4], int(m[5]) if m[5] else None, m[6] or None)
            for m in LEFT_WORKER.finditer(log)]


def _named(run: NodesRun, fault_t: float) -> tuple[tuple[int, str, float] | None, str]:
    """The rank and host a ppsync worker named, when (its record's time)."""
    lines = [n for node in range(2) for n in ppsync_named(run.log_text(node))]
    times = sorted(t for w in read_worker_records(run.run_dir / "records")
                   for t, *_ in w.errors if t >= fault_t)
    for who, call, typ, line, rank, host in lines:
        said = f"{who}: {call} raised {typ}: {line}"
        if rank is not None and host is not None:
            return (rank, host, times[0] - fault_t if times else float("nan")), said
    if lines:
        who, call, typ, line, _, _ = lines[0]
        return None, f"{who}: {call} raised {typ}: {line} (no rank named)"
    vllm = VLLM_ERROR.findall(run.log_text(0))
    return None, f"{vllm[0][0]} {vllm[0][1]}"[:300] if vllm else ""


def _fault(run: NodesRun, fault: str) -> None:
    if fault == "kill-node":
        run.pair.signal_all(1, signal.SIGKILL)
    elif fault == "stop-node":
        run.pair.signal_all(1, signal.SIGSTOP)
    else:
        run.pair.link_down(1)


def _one(label: str, ppsync: bool, nodes: NodesOptions, number: int, fault: str,
         bound_s: float) -> NodeFaultOutcome:
    run_dir = nodes.work / f"run-{number + 1}-{fault}-{'ppsync' if ppsync else 'vllm'}"
    per_node = nodes.spec.pp_size // 2
    marker = run_dir / "streaming.json"
    with NodesRun(run_dir, nodes.spec, (NodePlan(ppsync), NodePlan(ppsync)), nodes.env,
                  number=number) as run:
        base = NodeFaultOutcome(label=label, expect_ppsync=ppsync, fault=fault,
                                host1_ranks=tuple(range(per_node, 2 * per_node)),
                                host1_addr=run.pair.addr(1), fault_t=None, bound_s=bound_s)
        run.start()
        client = run.client(client_spec(
            run, fault_requests(nodes.seed), ready_timeout_s=nodes.timeout_s,
            request_timeout_s=bound_s, fault_marker=str(marker), marker_tokens=MARKER_TOKENS))
        try:
            run.wait(lambda: marker.exists() or client.poll() is not None or bool(run.exited()),
                     nodes.timeout_s)
            if not marker.exists():
                return _ended(base, run, error="the streams never got their first tokens "
                              f"(client log: {run_dir / 'client.log'})")
            fault_t = time.time()
            _fault(run, fault)
            head = run.nodes[0]
            run.wait(lambda: client.poll() is not None and head.poll() is not None, bound_s)
            head_s = None if head.poll() is None else time.time() - fault_t
            if head_s is not None:
                time.sleep(GRACE_S)
            left = tuple(run.left())
            named, line = _named(run, fault_t)
        finally:
            end_client(client)
    result = run.client_result()
    return _ended(base, run, fault_t=fault_t, streams=outcomes(result.get("burst")),
                  after=outcomes(result.get("after")), named=named, named_line=line,
                  head_ended_s=head_s, left=left)


def _ended(base: NodeFaultOutcome, run: NodesRun, **kw: object) -> NodeFaultOutcome:
    return replace(base, survivors=tuple(run.survivors), **kw)  # type: ignore[arg-type]


def node_fault_failures(o: NodeFaultOutcome, bound_s: float, teardown_s: float) -> list[str]:
    """Why ppsync's run of a host fault fails (vLLM's is not judged):
    ``bound_s`` to name the stage, ``teardown_s`` more for the client's error."""
    label = f"{o.label}, {o.fault}"
    if o.fault_t is None:
        return [f"{label}: {o.error}"]
    out = []
    if o.named is None:
        out.append(f"{label}: no ppsync worker named a PP rank and its host ({o.named_line!r})")
    else:
        rank, host, after = o.named
        if rank not in o.host1_ranks or o.host1_addr not in host:
            out.append(f"{label}: named PP rank {rank} on {host}, not one of host 1's "
                       f"{list(o.host1_ranks)} on {o.host1_addr}")
        if not after <= bound_s + SLACK_S:
            out.append(f"{label}: named {after:.1f} s after the fault (bound {bound_s:g} + "
                       f"{SLACK_S:g} s)")
    seen = o.client_error_s()
    if seen is None:
        out.append(f"{label}: the client got no error (only its own timeout, or nothing)")
    elif seen[1] > bound_s + SLACK_S + teardown_s:
        out.append(f"{label}: the client's first error came {seen[1]:.1f} s after the fault "
                   f"(bound {bound_s:g} + {SLACK_S:g} + vLLM's teardown {teardown_s:g} s)")
    if o.head_ended_s is None:
        out.append(f"{label}: host 0's head process was still running {o.bound_s:g} s after "
                   "the fault")
    host0 = [p for p in o.left if p.startswith("host 0")]
    if host0:
        out.append(f"{label}: left on host 0 {GRACE_S:g} s after the head ended: {host0}")
    if o.survivors:
        out.append(f"{label}: survived the final kill: {list(o.survivors)}")
    return out


def _rows(o: NodeFaultOutcome) -> list[tuple[str, str]]:
    if o.fault_t is None:
        return [("run", str(o.error))]
    seen = o.client_error_s()
    hung = [s for s in o.streams if s.error and "Timeout" in s.error.split(":")[0]]
    client = (f"{seen[0][:110]} ({seen[1]:.1f} s)" if seen else
              f"hung: {len(hung)} stream(s) hit the client's own {o.bound_s:g} s timeout"
              if hung else "no error")
    after = (o.after[0].error or f"{len(o.after[0].tokens)} tokens")[:90] if o.after else "-"
    named = (f"PP rank {o.named[0]} on {o.named[1]} ({o.named[2]:.1f} s)" if o.named else "none")
    host1 = [p.split(": ", 1)[1] for p in o.left if p.startswith("host 1")]
    return [("client's streams", client), ("a new request after", after),
            ("stage named", named), ("log line", o.named_line[:200] or "-"),
            ("head process ended", "still up at the bound" if o.head_ended_s is None
             else f"{o.head_ended_s:.1f} s after the fault"),
            ("left on host 0", str(sum(p.startswith("host 0") for p in o.left))),
            ("left on host 1", f"{len(host1)} ({', '.join(host1[:4])})" if host1 else "0"),
            ("after the final kill", str(len(o.survivors)))]


def format_node_faults(outcomes_: list[NodeFaultOutcome], bound_s: float,
                       teardown_s: float) -> str:
    """Both handlers' outcomes side by side, and the verdict on ppsync's."""
    fault = outcomes_[0].fault
    lines = ["", f"fault {fault} (host 1: PP rank(s) {list(outcomes_[0].host1_ranks)}), "
             f"each handler's engine (ppsync's bound to name the stage: {bound_s:g} s):"]
    rows = [_rows(o) for o in outcomes_]
    for i, (name, _) in enumerate(rows[0]):
        lines.append(f"  {name}:")
        for o, r in zip(outcomes_, rows, strict=True):
            lines.append(f"    {o.label:<18} {r[i][1] if i < len(r) else '-'}")
    why = [w for o in outcomes_ if o.expect_ppsync
           for w in node_fault_failures(o, bound_s, teardown_s)]
    lines.append("")
    lines += (["FAIL", *(f"  {w}" for w in why)] if why else [
        f"PASS: {fault}: ppsync named host 1's stage within {bound_s:g} + {SLACK_S:g} s, the "
        f"client got an error within that + vLLM's teardown ({teardown_s:g} s), and nothing was "
        "left on either host (vLLM's handler: reported above, not judged)"])
    return "\n".join(lines)


def run_node_fault(nodes: NodesOptions, fault: str, bound_s: float) -> int:
    """The fault with each handler; exit 1 unless ppsync's run passed."""
    settings = settings_from_env(nodes.env)
    detect = detection_bound_s(settings)
    env = dict(nodes.env)
    env.setdefault(EXECUTE_ENV, str(EXECUTE_TIMEOUT_S))
    teardown = float(env[EXECUTE_ENV]) + TEARDOWN_SLACK_S
    watch = max(bound_s, detect + SLACK_S + teardown + GRACE_S)
    print(f"  vLLM's teardown: {EXECUTE_ENV}={env[EXECUTE_ENV]} in both runs (vLLM's bound on "
          "one step's result, which the head's engine core waits for from host 1); each run "
          f"watched up to {watch:g} s after the fault", flush=True)
    nodes = replace(nodes, env=env)
    results = []
    for number, (label, ppsync) in enumerate((("vLLM's PPHandler", False),
                                              ("ppsync's plugin", True))):
        print(f"  run {number + 1} of 2 ({label}, fault {fault}) ...", flush=True)
        results.append(_one(label, ppsync, nodes, number, fault, watch))
    print(format_node_faults(results, detect, teardown), flush=True)
    return 1 if any(node_fault_failures(o, detect, teardown)
                    for o in results if o.expect_ppsync) else 0

