"""One served engine across two hosts for ``vllm-check --nodes 2``: the hosts
(ppsync.checks.vllm.nodes), vLLM's own multi-node launch on them,
the HTTP client on the head's host, and the end of it all, bounded.

vLLM's multiprocessing executor across nodes: host 0 runs ``vllm serve
MODEL --nnodes 2 --node-rank 0 --master-addr <host 0>`` (the API server,
the engine core and the first PP ranks), host 1 the same with
``--node-rank 1 --headless`` (the later PP ranks only); each node's
environment names its own veth in ``GLOO_SOCKET_IFNAME`` and its address
in ``VLLM_HOST_IP``, and carries its own ``PPSYNC_*`` (a :class:`NodePlan`).
Every process of a run lives in one of the two namespaces, and both are
deleted at its end, whatever happened (:class:`NodesRun`).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, TextIO

from ppsync.checks.vllm import worker_hooks
from ppsync.checks.vllm.nodes import HostPair
from ppsync.checks.vllm.workload import Request
from ppsync.compat.vllm.plugin import ENV_SWITCH

__all__ = ["API_PORT", "MASTER_PORT", "NodePlan", "NodesOptions", "NodesRun", "ServeSpec",
           "client_spec", "end_client", "node_env", "serve_command"]

API_PORT = 8000
MASTER_PORT = 29500  # inside namespaces made for the run: nothing else listens there
POLL_S = 0.25


@dataclass(frozen=True)
class ServeSpec:
    """What both nodes serve (the same on each, as vLLM requires)."""

    model: str
    pp_size: int
    dtype: str
    max_model_len: int
    max_num_seqs: int
    seed: int
    nnodes: int = 2


@dataclass(frozen=True)
class NodePlan:
    """One host's own settings: ppsync's switch and extra variables."""

    ppsync: bool
    env: tuple[tuple[str, str], ...] = ()

    def describe(self) -> str:
        extra = "".join(f", {k}={v}" for k, v in self.env)
        return f"{ENV_SWITCH}={'1' if self.ppsync else 'unset'}{extra}"


def serve_command(spec: ServeSpec, node: int, master_addr: str) -> list[str]:
    """vLLM's multi-node launch for ``node`` (0: head with the API server)."""
    cmd = [sys.executable, "-m", "ppsync.checks.vllm.node_main", "serve", spec.model,
           "--load-format", "dummy", "--skip-tokenizer-init", "--dtype", spec.dtype,
           "--pipeline-parallel-size", str(spec.pp_size), "--distributed-executor-backend", "mp",
           "--nnodes", str(spec.nnodes), "--node-rank", str(node), "--master-addr", master_addr,
           "--master-port", str(MASTER_PORT), "--enforce-eager",
           "--max-model-len", str(spec.max_model_len),
           "--max-num-batched-tokens", str(spec.max_model_len),
           "--max-num-seqs", str(spec.max_num_seqs), "--seed", str(spec.seed)]
    if node:
        return [*cmd, "--headless"]
    # the head logs each request it aborts ("Aborted request(s) ..."): how
    # the check sees a client's cancel reach the engine mid-generation
    return [*cmd, "--host", master_addr, "--port", str(API_PORT), "--enable-log-requests"]


def node_env(env: Mapping[str, str], plan: NodePlan, *, ifname: str, addr: str, label: str,
             records: Path) -> dict[str, str]:
    """One node's environment: the run's, its veth and address, the check's
    recording, and its own ppsync switch and variables."""
    out = dict(env)
    out.update(GLOO_SOCKET_IFNAME=ifname, VLLM_HOST_IP=addr)
    out[worker_hooks.ENV_NODE] = label
    out[worker_hooks.ENV_RECORD] = str(records)
    if plan.ppsync:
        out[ENV_SWITCH] = "1"
    else:
        out.pop(ENV_SWITCH, None)
    out.update(plan.env)
    return out


@dataclass
class NodesRun:
    """The hosts and processes of one run; a context manager whose exit
    deletes both hosts with everything on them."""

    run_dir: Path
    spec: ServeSpec
    plans: Sequence[NodePlan]
    env: Mapping[str, str]
    number: int = 0
    nice: bool = True
    hosts: HostPair | None = None
    nodes: list[subprocess.Popen[bytes]] = field(default_factory=list)
    logs: list[TextIO] = field(default_factory=list)
    survivors: list[str] = field(default_factory=list)  # alive after the final kill

    def __enter__(self) -> NodesRun:
        (self.run_dir / "records").mkdir(parents=True, exist_ok=True)
        self.hosts = HostPair(self.number)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        for proc in self.nodes:
            if proc.poll() is None:
                proc.kill()
        if self.hosts is not None:
            self.survivors = self.hosts.remove()
        for proc in self.nodes:
            proc.wait()
        for f in self.logs:
            f.close()

    @property
    def pair(self) -> HostPair:
        assert self.hosts is not None, "used outside its with block"
        return self.hosts

    def label(self, node: int) -> str:
        return f"host {node} ({self.pair.addr(node)})"

    def log_path(self, node: int) -> Path:
        return self.run_dir / f"node-{node}.log"

    def start(self) -> None:
        """Start every node (the head first)."""
        pair = self.pair
        for node, plan in enumerate(self.plans):
            env = node_env(self.env, plan, ifname=pair.ifnames[node], addr=pair.addr(node),
                           label=self.label(node), records=self.run_dir / "records")
            cmd = [*pair.exec_prefix(node), *(["nice", "-n", "5"] if self.nice else []),
                   *serve_command(self.spec, node, pair.addr(0))]
            log = self.log_path(node).open("w")
            self.logs.append(log)
            self.nodes.append(subprocess.Popen(cmd, env=env, stdout=log,
                                               stderr=subprocess.STDOUT,
                                               stdin=subprocess.DEVNULL, cwd=self.run_dir,
                                               start_new_session=True))

    def exited(self) -> dict[int, int]:
        """Nodes whose launching process has ended, with its status."""
        return {n: p.returncode for n, p in enumerate(self.nodes) if p.poll() is not None}

    def client(self, spec: dict[str, Any], name: str = "client") -> subprocess.Popen[bytes]:
        """The HTTP client on host 0 (writes ``name``.json; log ``name``.log)."""
        spec_file = self.run_dir / f"{name}-spec.json"
        spec_file.write_text(json.dumps(spec))
        log = (self.run_dir / f"{name}.log").open("w")
        self.logs.append(log)
        cmd = [*self.pair.exec_prefix(0), sys.executable, "-m",
               "ppsync.checks.vllm.http_client", str(spec_file),
               str(self.run_dir / f"{name}.json")]
        return subprocess.Popen(cmd, env=dict(self.env), stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, cwd=self.run_dir,
                                start_new_session=True)

    def client_result(self, name: str = "client") -> dict[str, Any]:
        path = self.run_dir / f"{name}.json"
        result: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {}
        return result

    def wait(self, until: Callable[[], bool], timeout_s: float) -> bool:
        """Poll ``until`` for at most ``timeout_s``; whether it came true."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if until():
                return True
            time.sleep(POLL_S)
        return until()

    def stop(self, grace_s: float = 30.0, headless_s: float = 15.0) -> str:
        """End a healthy run as an operator would: SIGTERM the head, then see
        whether the headless node ends on its own, then SIGTERM it; what
        happened, in words (the namespaces' deletion kills what is left)."""
        head, rest = self.nodes[0], self.nodes[1:]
        t0 = time.monotonic()
        if head.poll() is None:
            head.send_signal(signal.SIGTERM)
        if not self.wait(lambda: head.poll() is not None, grace_s):
            return f"the head did not end within {grace_s:g} s of SIGTERM (killed)"
        said = [f"head ended {time.monotonic() - t0:.1f} s after SIGTERM (status "
                f"{head.returncode})"]
        t1 = time.monotonic()
        if self.wait(lambda: all(p.poll() is not None for p in rest), headless_s):
            said.append(f"headless node ended on its own {time.monotonic() - t1:.1f} s later")
            return "; ".join(said)
        for p in rest:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        t2 = time.monotonic()
        if self.wait(lambda: all(p.poll() is not None for p in rest), headless_s):
            said.append(f"headless node still up {headless_s:g} s after the head; it ended "
                        f"{time.monotonic() - t2:.1f} s after its own SIGTERM")
        else:
            said.append(f"headless node still up {headless_s:g} s after the head and "
                        f"{headless_s:g} s after its own SIGTERM (killed)")
        return "; ".join(said)

    def left(self) -> list[str]:
        """Live processes on either host, as "host N: pid state name"."""
        return [f"host {n}: {p}" for n in range(2) for p in self.pair.live(n)]

    def log_text(self, node: int) -> str:
        for f in self.logs:
            if not f.closed:
                f.flush()
        path = self.log_path(node)
        return path.read_text(errors="replace") if path.exists() else ""


@dataclass(frozen=True)
class NodesOptions:
    """What every ``--nodes`` run shares."""

    spec: ServeSpec
    work: Path
    env: dict[str, str]
    seed: int
    requests: int
    timeout_s: float  # one run, from the nodes' start to the client's end


def client_spec(run: NodesRun, requests: list[Request], *, ready_timeout_s: float,
                request_timeout_s: float, **extra: Any) -> dict[str, Any]:
    """The HTTP client's instructions (ppsync.checks.vllm.http_client)."""
    cancelled = [r.id for r in requests if r.cancel_after is not None]
    return {"base_url": f"http://{run.pair.addr(0)}:{API_PORT}", "model": run.spec.model,
            "ready_timeout_s": ready_timeout_s, "request_timeout_s": request_timeout_s,
            "requests": [r.as_json() for r in requests], "replays": cancelled,
            "veth": run.pair.ifnames[0], **extra}


def end_client(client: subprocess.Popen[bytes]) -> None:
    """Stop the client if it still runs (its session, with whatever it started)."""
    if client.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(client.pid, signal.SIGKILL)
    client.wait()
