"""One SGLang engine run of ``ppsync sglang-check`` (a child process of the
check, run with the SGLang venv's python).

``python -m ppsync.checks.sglang.engine SPEC.json`` writes a tiny
Llama config (no weights: SGLang's ``load_format="dummy"``), starts SGLang's
offline ``Engine`` at ``pp_size`` on the CPU (torch-native attention,
PyTorch sampling: the CPU shims of ``make sglang-check``), generates
greedily for the prompts (token ids: no tokenizer), and then, with a
``fault``, SIGKILLs or SIGSTOPs the last stage's scheduler and generates
again. It reports each event as one line on stdout, ``EVENT_PREFIX`` and a
JSON object: ``up``, ``stages`` (each stage's scheduler pid), ``generate``
(a call begins), ``tokens``, ``fault``, then ``tokens`` or ``error`` for
the call after the fault, and ``shutdown``. A call that never returns
reports nothing more: the check judges by the clock. Whether the guard
runs is the environment's choice (``PPSYNC_SGLANG``), not this module's.

The fault ``slow-last`` signals nothing: ``PPSYNC_SGLANG_CHECK_SLOW=STAGE:N:
SECONDS`` makes stage STAGE's scheduler sleep SECONDS before its N-th
``run_batch`` (a healthy stage slow in one step: its process and its
guard's watcher thread alive), which reports a ``slow`` event; the caller
generates twice. SGLang starts its schedulers with ``spawn``, which runs
this module again in each of them as ``__mp_main__``: there, and only
there, the variable installs the stall (:func:`install_slow`).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

EVENT_PREFIX = "PPSYNC-SGLANG-CHECK "
TINY_LLAMA: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama",
    "hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 32, "num_hidden_layers": 4,
    "vocab_size": 512, "max_position_embeddings": 512, "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0, "hidden_act": "silu", "tie_word_embeddings": False,
    "torch_dtype": "float32", "bos_token_id": 1, "eos_token_id": 2,
}
"""A 4-layer Llama small enough for two CPU stages; dummy weights."""
FAULT_SIGNALS = {"kill-last": signal.SIGKILL, "stop-last": signal.SIGSTOP}
ENV_SLOW = "PPSYNC_SGLANG_CHECK_SLOW"
SCHEDULER = "sglang.srt.managers.scheduler"


def emit(event: str, **fields: object) -> None:
    print(EVENT_PREFIX + json.dumps({"event": event, "t": time.monotonic(), **fields}),
          flush=True)


def stage_pids(pp_size: int) -> dict[int, int]:
    """Each stage's scheduler process, by the title SGLang gives it
    (``sglang::scheduler_PP<stage>``)."""
    import psutil

    pids: dict[int, int] = {}
    for child in psutil.Process().children(recursive=True):
        try:
            title = " ".join(child.cmdline())
        except psutil.Error:
            continue
        for stage in range(pp_size):
            if f"scheduler_PP{stage}" in title:
                pids[stage] = child.pid
    return pids


def slowed_run_batch(run_batch: Callable[..., Any], stage: int, after: int,
                     seconds: float) -> Callable[..., Any]:
    """``Scheduler.run_batch`` that, on stage ``stage``, sleeps ``seconds``
    before its ``after``-th call, once, and reports it (a ``slow`` event)."""
    count = [0]

    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        if self.pp_group.rank_in_group == stage:
            count[0] += 1
            if count[0] == after:
                t0 = time.monotonic()
                time.sleep(seconds)
                emit("slow", stage=stage, step=after, seconds=time.monotonic() - t0)
        return run_batch(self, *args, **kwargs)

    return run


def install_slow(raw: str) -> None:
    """Patch SGLang's ``Scheduler.run_batch`` as ``PPSYNC_SGLANG_CHECK_SLOW``
    (``raw``) asks, once the scheduler's module is imported."""
    from ppsync.checks.vllm.worker_hooks import AfterImport

    stage, after, seconds = raw.split(":")

    def patch(module: ModuleType) -> None:
        cls = module.Scheduler
        cls.run_batch = slowed_run_batch(cls.run_batch, int(stage), int(after), float(seconds))

    if SCHEDULER in sys.modules:
        patch(sys.modules[SCHEDULER])
    else:
        sys.meta_path.insert(0, AfterImport({SCHEDULER: patch}))


def generate(llm: Any, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    params = {"temperature": 0.0, "max_new_tokens": max_tokens, "ignore_eos": True}
    outs = llm.generate(input_ids=prompts, sampling_params=params)
    return [list(o["output_ids"]) for o in outs]


def main(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    model = Path(spec["work_dir"]) / "tiny-llama"
    model.mkdir(parents=True, exist_ok=True)
    (model / "config.json").write_text(json.dumps(TINY_LLAMA))
    os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
    os.environ.setdefault("SGLANG_CPU_OMP_THREADS_BIND",
                          "|".join(str(i % (os.cpu_count() or 1)) for i in range(spec["pp_size"])))
    import sglang

    t0 = time.monotonic()
    # mem_fraction_static is large on purpose: SGLang's start-up check reads the
    # memory other processes took while the weights loaded as the weights'
    # (0.05 failed on this shared machine); max_total_tokens caps the KV pool
    llm = sglang.Engine(
        model_path=str(model), load_format="dummy", skip_tokenizer_init=True, device="cpu",
        dtype="bfloat16", pp_size=spec["pp_size"], tp_size=1,
        attention_backend="torch_native", sampling_backend="pytorch",
        disable_cuda_graph=True, disable_overlap_schedule=True, mem_fraction_static=0.6,
        max_total_tokens=4096, max_running_requests=8, chunked_prefill_size=256,
        random_seed=spec["seed"], log_level="warning")
    emit("up", seconds=time.monotonic() - t0)
    pids = stage_pids(spec["pp_size"])
    emit("stages", pids={str(k): v for k, v in pids.items()})
    prompts: list[list[int]] = spec["prompts"]
    emit("generate", call=0)
    emit("tokens", call=0, tokens=generate(llm, prompts, spec["max_tokens"]))
    fault = spec.get("fault")
    if fault == "slow-last":  # the stall was in call 0; the engine goes on
        emit("generate", call=1)
        emit("tokens", call=1, tokens=generate(llm, prompts, spec["max_tokens"]))
    elif fault:
        last = spec["pp_size"] - 1
        os.kill(pids[last], FAULT_SIGNALS[fault])
        emit("fault", fault=fault, stage=last, pid=pids[last])
        try:
            emit("tokens", call=1, tokens=generate(llm, prompts, spec["max_tokens"]))
        except Exception as e:  # what the caller of generate() sees
            emit("error", type=type(e).__name__, message=str(e)[:2000])
    llm.shutdown()
    emit("shutdown")
    return 0


if __name__ == "__mp_main__" and os.environ.get(ENV_SLOW):  # a process SGLang spawned
    install_slow(os.environ[ENV_SLOW])

if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
