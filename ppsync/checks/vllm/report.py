"""What ``ppsync vllm-check`` found, compared and printed: no vLLM here.

A run is one vLLM engine at pipeline_parallel_size P: the handler class each
of its P workers built (read from the records the check's worker hooks
write, ppsync.checks.vllm.worker_hooks), the tokens of every
``generate`` call (``[call][prompt] -> token ids``), and the durations of
each ``generate`` and of each handler ``receive`` / ``broadcast`` /
``get_prev_sampled_outputs`` call. The
check passes when the run with vLLM's own handler built vLLM's in every
worker, the run with ppsync's plugin built ppsync's in every worker, both
ran to the end, and their tokens are identical; with speculative decoding
(K > 0) also that vLLM accepted draft tokens in both runs (else the draft
path was not tested).
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ppsync.compat.vllm.calls import HANDLER_CALLS

__all__ = ["NGRAM_METHODS", "RunResult", "SpecFigures", "WorkerRecord", "failures", "format_report",
           "handler_failures", "path_line", "read_workarounds", "read_worker_records",
           "spec_figures", "token_differences"]

NGRAM_METHODS = ("ngram", "ngram_gpu")  # vLLM's model-free proposers (prompt lookup)
MULTI_SHOWN = 12  # steps listed where a row had num_sampled > 1
PATH_FACTS = ("codec", "carrier", "cpu_kernels", "device_kernels", "completion",
              "token_backend")


@dataclass(frozen=True)
class WorkerRecord:
    """One worker process of a run, as its hook recorded it."""

    pid: int
    pp_rank: int
    pp_size: int
    runner: str
    handler: str | None  # module.qualname of the handler class it built; None: none built
    ppsync: bool  # the class is a subclass of ppsync.compat.vllm.handler.PPHandler
    receive_s: tuple[float, ...] = ()  # each receive call, seconds
    prev_s: tuple[float, ...] = ()  # each get_prev_sampled_outputs call, seconds
    broadcast_s: tuple[float, ...] = ()  # each broadcast call, seconds
    receive_all_rows: int = 0  # receive calls that returned True (every row needs a sample)
    receive_rows: tuple[int, ...] = ()  # each receive call's batch rows (num_reqs)
    drafts_s: tuple[float, ...] = ()  # each broadcast_drafts call, seconds
    steps: int = 0  # steps with sampled outputs: broadcast (last rank) or
    # get_prev_sampled_outputs that returned them (the others)
    multi_steps: tuple[int, ...] = ()  # which of those (0-based) had a row with num_sampled > 1
    path: dict[str, str] = field(default_factory=dict)  # ppsync: codec, kernels, completion
    twin: tuple[int, int, int] | None = None  # the twin's last counts: engine-stream waits
    # on unconsumed transfers, on consumed ones, side-stream waits (None: not on the twin)
    errors: tuple[tuple[float, str, str, str], ...] = ()  # (time, call, type, first line)
    fault: tuple[float, str, int] | None = None  # (time, action, step) of its own fault
    slow: tuple[float, float, int] | None = None  # (time, seconds, step) of its own stall
    node: str = ""  # the host it ran on (vllm-check --nodes), as the check named it
    gloo_ifname: str = ""  # its GLOO_SOCKET_IFNAME
    frames: int = 0  # ppsync's last rank: frames its token group sent
    frame_bytes: int = 0  # ppsync: one frame's size on the wire


@dataclass(frozen=True)
class SpecFigures:
    """vLLM's speculative-decoding counters of one run (its metrics)."""

    drafts: int | None = None
    draft_tokens: int | None = None
    accepted: int | None = None
    per_position: tuple[int, ...] = ()

    def text(self) -> str:
        def n(v: int | None) -> str:
            return "?" if v is None else str(v)

        rate = (f" ({100 * self.accepted / self.draft_tokens:.1f}% of draft tokens)"
                if self.accepted is not None and self.draft_tokens else "")
        pos = (f"; accepted per position: {', '.join(map(str, self.per_position))}"
               if self.per_position else "")
        return (f"{n(self.drafts)} drafts, {n(self.draft_tokens)} draft tokens, "
                f"{n(self.accepted)} accepted{rate}{pos}")


def spec_figures(raw: object) -> SpecFigures | None:
    """SpecFigures from the engine child's ``spec`` entry (None: none there)."""
    if not isinstance(raw, dict):
        return None

    def count(key: str) -> int | None:
        v = raw.get(key)
        return v if isinstance(v, int) else None

    per_pos = raw.get("accepted_per_position", ())
    return SpecFigures(count("drafts"), count("draft_tokens"), count("accepted"),
                       tuple(int(v) for v in per_pos) if isinstance(per_pos, list) else ())


@dataclass(frozen=True)
class RunResult:
    """One vLLM engine run of the check."""

    label: str
    expect_ppsync: bool  # which handler every worker must have built
    workers: tuple[WorkerRecord, ...] = ()
    tokens: tuple[tuple[tuple[int, ...], ...], ...] = ()  # [call][prompt] token ids
    generate_s: tuple[float, ...] = ()  # each generate call, seconds
    error: str | None = None  # why the run did not finish
    log: str | None = None  # where vLLM's own output went
    notes: tuple[str, ...] = field(default=())
    spec: SpecFigures | None = None  # vLLM's acceptance counters (speculative decoding)
    workarounds: dict[str, int] = field(default_factory=dict)  # name -> processes it acted in
    caller: dict[str, str] | None = None  # the error generate raised: type, first_line, text
    ended_at: float | None = None  # when generate raised (time.time())
    calls_at: tuple[tuple[float, float], ...] = ()  # each generate call's start and end
    # (time.time())


def read_workarounds(record_dir: Path) -> dict[str, int]:
    """How many processes each work-around hook acted in (its records)."""
    out: dict[str, int] = {}
    for path in sorted(record_dir.glob("workaround-*.jsonl")):
        names = set()
        for line in path.read_text().splitlines():
            try:
                names.add(str(json.loads(line)["event"]))
            except (json.JSONDecodeError, KeyError, TypeError):
                continue
        for name in names:
            out[name] = out.get(name, 0) + 1
    return out


def read_worker_records(record_dir: Path) -> tuple[WorkerRecord, ...]:
    """The records the worker hooks wrote under ``record_dir``, by PP rank
    (a line cut short by a killed worker is skipped)."""
    workers = []
    for path in sorted(record_dir.glob("worker-*.jsonl")):
        head: dict[str, object] | None = None
        calls: dict[str, list[float]] = {name: [] for name in HANDLER_CALLS}
        all_rows = steps = 0
        rows: list[int] = []
        multi: list[int] = []
        twin: tuple[int, int, int] | None = None
        errors: list[tuple[float, str, str, str]] = []
        fault: tuple[float, str, int] | None = None
        slow: tuple[float, float, int] | None = None
        frames = 0
        for line in path.read_text().splitlines():
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                continue
            if event.get("event") == "handler":
                head = event
            elif event.get("event") == "twin":
                twin = tuple(int(c) for c in event["counts"])  # type: ignore[assignment]
            elif event.get("event") == "error":
                errors.append((float(event["t"]), str(event["call"]), str(event["type"]),
                               str(event["line"])))
            elif event.get("event") == "fault":
                fault = (float(event["t"]), str(event["action"]), int(event["step"]))
            elif event.get("event") == "slow":
                slow = (float(event["t"]), float(event["s"]), int(event["step"]))
            elif event.get("event") in calls:
                calls[event["event"]].append(float(event["s"]))
                frames = max(frames, int(event.get("seq", 0)))
                all_rows += event.get("returned") is True
                if event["event"] == "receive" and isinstance(event.get("rows"), int):
                    rows.append(event["rows"])
                if isinstance(event.get("multi"), int):  # the call had sampled outputs
                    if event["multi"] > 0:
                        multi.append(steps)
                    steps += 1
        if head is None:
            continue
        handler = head.get("handler")
        workers.append(WorkerRecord(
            pid=int(str(head["pid"])), pp_rank=int(str(head["pp_rank"])),
            pp_size=int(str(head["pp_size"])), runner=str(head.get("runner", "?")),
            handler=None if handler is None else str(handler), ppsync=bool(head.get("ppsync")),
            receive_s=tuple(calls["receive"]), broadcast_s=tuple(calls["broadcast"]),
            prev_s=tuple(calls["get_prev_sampled_outputs"]), receive_all_rows=all_rows,
            receive_rows=tuple(rows), drafts_s=tuple(calls["broadcast_drafts"]),
            steps=steps, multi_steps=tuple(multi), twin=twin, errors=tuple(errors),
            fault=fault, slow=slow, path={k: str(head[k]) for k in PATH_FACTS if k in head},
            node=str(head.get("node", "")), gloo_ifname=str(head.get("gloo_ifname", "")),
            frames=frames, frame_bytes=int(str(head.get("frame_bytes", 0)))))
    return tuple(sorted(workers, key=lambda w: (w.pp_rank, w.pid)))


def token_differences(a: RunResult, b: RunResult, limit: int = 5) -> list[str]:
    """Where the two runs' tokens differ (at most ``limit`` lines; empty: identical)."""
    out: list[str] = []
    if len(a.tokens) != len(b.tokens):
        return [f"{a.label} made {len(a.tokens)} generate calls, {b.label} {len(b.tokens)}"]
    for call, (pa, pb) in enumerate(zip(a.tokens, b.tokens, strict=True)):
        if len(pa) != len(pb):
            out.append(f"call {call}: {len(pa)} prompts against {len(pb)}")
            continue
        for prompt, (ta, tb) in enumerate(zip(pa, pb, strict=True)):
            if ta == tb:
                continue
            at = next((i for i, (x, y) in enumerate(zip(ta, tb, strict=False)) if x != y),
                      min(len(ta), len(tb)))
            out.append(f"call {call} prompt {prompt}: first difference at token {at} "
                       f"({list(ta[at:at + 4])} against {list(tb[at:at + 4])}; "
                       f"{len(ta)} and {len(tb)} tokens)")
    return out[:limit] + ([f"... {len(out) - limit} more"] if len(out) > limit else [])


def handler_failures(run: RunResult, pp_size: int) -> list[str]:
    """Why ``run``'s workers fail: a rank that recorded nothing, a handler
    not the one asked for, engine-stream waits on unconsumed transfers."""
    out = []
    want = "ppsync's" if run.expect_ppsync else "vLLM's own"
    ranks = sorted({w.pp_rank for w in run.workers})
    if ranks != list(range(pp_size)):
        out.append(f"{run.label}: handler records from PP ranks {ranks}, expected 0..{pp_size - 1} "
                   "(a worker that built no model runner, or whose hook did not load)")
    for w in run.workers:
        if w.ppsync != run.expect_ppsync or w.handler is None:
            out.append(f"{run.label}: worker pid {w.pid} (PP rank {w.pp_rank}) built "
                       f"{w.handler or 'no handler'}, not {want} PPHandler")
        if w.twin is not None and w.twin[0]:
            out.append(f"{run.label}: PP rank {w.pp_rank}: {w.twin[0]} engine-stream waits on "
                       "transfers not yet consumed (the twin of a stream-ordered backend: must "
                       "be 0)")
    return out


def path_line(w: WorkerRecord) -> str:
    """What a ppsync worker's token path ran, and the twin's counts."""
    p = w.path
    if not p:
        return ""
    twin = "" if w.twin is None else (
        f"; twin: {w.twin[0]} engine-stream waits on unconsumed transfers, {w.twin[1]} on "
        f"consumed ones, {w.twin[2]} side-stream waits")
    if "twin of" in p.get("completion", "") and w.twin is None:
        twin = "; twin: no wait counted"
    kernels = (f"device kernels {p.get('device_kernels')}" if p.get("codec") == "device"
               else f"CPU kernels {p.get('cpu_kernels')}")
    return (f"codec {p.get('codec')}, {kernels}, semantics {p.get('completion')}{twin}")


def spec_failures(run: RunResult) -> list[str]:
    """With speculative decoding: why ``run`` did not test the draft path."""
    if run.error is not None:
        return []
    if run.spec is None or run.spec.accepted is None:
        return [f"{run.label}: vLLM reported no speculative-decoding counters, so whether any "
                "draft was accepted is unknown: the draft path was not tested"]
    if run.spec.accepted == 0:
        return [f"{run.label}: no draft token was accepted ({run.spec.text()}): the draft path "
                "was not tested (prompts whose continuations repeat, or more --max-tokens, "
                "give the proposer matches)"]
    return [f"{run.label}: vLLM accepted drafts but PP rank {w.pp_rank}'s handler saw no step "
            "with a row of num_sampled > 1" for w in run.workers if w.steps and not w.multi_steps]


def failures(base: RunResult, ours: RunResult, pp_size: int, spec: int = 0) -> list[str]:
    """Why the check fails; empty when it passes (``spec``: K draft tokens)."""
    out = []
    for run in (base, ours):
        if run.error is not None:
            out.append(f"{run.label}: did not finish: {run.error}")
    for run in (base, ours):
        out += handler_failures(run, pp_size)
    if base.error is None and ours.error is None:
        diffs = token_differences(base, ours)
        out += [f"tokens differ: {d}" for d in diffs]
    if spec:
        for run in (base, ours):
            out += spec_failures(run)
    return out


def _ms(values: Sequence[float]) -> str:
    if not values:
        return "-"
    ms = [v * 1e3 for v in values]
    return (f"{len(ms)} calls: mean {statistics.fmean(ms):.3f} ms, median "
            f"{statistics.median(ms):.3f} ms, max {max(ms):.3f} ms")


def _counts(values: Sequence[int]) -> str:
    """``{4: 20, 2: 6}`` as ``4 x20, 2 x6`` (most rows first)."""
    return ", ".join(f"{v} x{values.count(v)}" for v in sorted(set(values), reverse=True))


def _rank_lines(w: WorkerRecord, spec: int) -> list[str]:
    last = w.pp_rank == w.pp_size - 1
    role = "last" if last else ("first" if w.pp_rank == 0 else "middle")
    out = [f"    PP rank {w.pp_rank}/{w.pp_size} ({role}, pid {w.pid}):"]
    if last:
        out.append(f"      broadcast: {_ms(w.broadcast_s)}")
        if spec:
            out.append(f"      broadcast_drafts: {_ms(w.drafts_s)}")
    else:
        rows = f"; rows per call: {_counts(list(w.receive_rows))}" if w.receive_rows else ""
        out.append(f"      receive: {_ms(w.receive_s)}; returned True (every row needs a "
                   f"sample) in {w.receive_all_rows}{rows}")
        table = " (scatters drafts into the draft table)" if spec else ""
        out.append(f"      get_prev_sampled_outputs{table}: {_ms(w.prev_s)}")
    if spec:
        shown = ", ".join(map(str, w.multi_steps[:MULTI_SHOWN]))
        more = ", ..." if len(w.multi_steps) > MULTI_SHOWN else ""
        where = "broadcast" if last else "received"
        out.append(f"      steps whose {where} outputs had a row with num_sampled > 1: "
                   f"{len(w.multi_steps)} of {w.steps}" + (f" ({shown}{more})" if shown else ""))
    return out


def format_report(base: RunResult, ours: RunResult, pp_size: int,
                  header: Sequence[str] = (), spec: int = 0, section: Sequence[str] = (),
                  more_failures: Sequence[str] = (), passed_also: str = "") -> str:
    """The check's printed report: header lines, the handler each worker
    built, the token comparison, vLLM's acceptance counters (``spec``: K > 0),
    the timings per rank, ``section`` (a fault's own lines) and the verdict
    (failing for ``more_failures`` too; ``passed_also`` ends the PASS line)."""
    lines = list(header)
    lines.append("")
    lines.append("handler built in each worker:")
    for run in (base, ours):
        if not run.workers:
            lines.append(f"  {run.label}: no worker recorded a handler")
        for w in run.workers:
            mark = "ppsync" if w.ppsync else "vLLM"
            lines.append(f"  {run.label}: PP rank {w.pp_rank}/{w.pp_size} (pid {w.pid}, "
                         f"{w.runner}): {w.handler or 'none'} [{mark}]")
            if w.path:
                lines.append(f"    ran: {path_line(w)}")
    lines.append("")
    if base.error is None and ours.error is None:
        diffs = token_differences(base, ours)
        prompts = len(base.tokens[0]) if base.tokens else 0
        counts = sorted({len(t) for call in base.tokens for t in call})
        if diffs:
            lines.append("tokens: DIFFER")
            lines += [f"  {d}" for d in diffs]
        else:
            lines.append(f"tokens: identical ({len(base.tokens)} generate calls x {prompts} "
                         f"prompts, {'/'.join(map(str, counts))} tokens each)")
        for i, t in enumerate(base.tokens[0] if base.tokens else ()):
            lines.append(f"  prompt {i}: {list(t)}")
    else:
        lines.append("tokens: not compared (a run did not finish)")
    lines.append("")
    if spec:
        lines.append(f"speculative decoding (K={spec}), vLLM's counters over both generate "
                     "calls:")
        for run in (base, ours):
            lines.append(f"  {run.label}: "
                         f"{run.spec.text() if run.spec else 'none reported'}")
        lines.append("")
    lines.append("timing, per PP rank:")
    for run in (base, ours):
        gen = ", ".join(f"{s:.2f} s" for s in run.generate_s) or "-"
        lines.append(f"  {run.label}: generate {gen}")
        for w in run.workers:
            lines += _rank_lines(w, spec)
    for run in (base, ours):
        if run.log is not None:
            lines.append(f"  vLLM's output of {run.label}: {run.log}")
        lines += [f"  {n}" for n in run.notes]
    applied = [f"{run.label}: {name} in {n} process{'es' if n > 1 else ''}"
               for run in (base, ours) for name, n in sorted(run.workarounds.items())]
    if applied:
        lines.append("  work-arounds that acted: " + "; ".join(applied))
    lines.append("")
    if section:
        lines += [*section, ""]
    why = failures(base, ours, pp_size, spec) + list(more_failures)
    if why:
        lines.append("FAIL")
        lines += [f"  {w}" for w in why]
    else:
        accepted = (f", with speculative decoding (K={spec}; drafts accepted in both runs: "
                    f"{base.spec.accepted if base.spec else '?'} and "
                    f"{ours.spec.accepted if ours.spec else '?'} tokens)" if spec else "")
        lines.append(f"PASS: ppsync's handler was built in all {pp_size} workers and its tokens "
                     f"are identical to vLLM's own handler's{accepted}{passed_also}")
    return "\n".join(lines)
