"""One vLLM engine run of ``ppsync vllm-check`` (a child process of the check).

``python -m ppsync.checks.vllm.engine SPEC.json OUT.json`` builds
vLLM's offline ``LLM`` with the model, pipeline size and settings of
SPEC, generates greedily for SPEC's prompts (token ids: the model has no
tokenizer) ``calls`` times, and writes the tokens of every call and each
call's duration and its start and end (wall clock) to OUT (a call that
raises: its error as the caller saw it, and the time; then it goes on);
with ``idle_s`` the engine idles that long between calls, alive with no
request (vllm-check --fault idle); with ``spec`` (K > 0) speculative decoding with
``spec_method`` and K draft tokens (n-gram lookups of 2 to 3 tokens for the
n-gram methods), and vLLM's acceptance counters after the last call. Which
handler vLLM builds is decided by the environment the check gives this
process (``PPSYNC_VLLM``), and recorded by the worker hooks, not here. vLLM
starts its workers with ``spawn``, which imports this module again in them:
everything runs under ``__main__``.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from ppsync.checks.vllm.report import NGRAM_METHODS

SPEC_COUNTERS = {"vllm:spec_decode_num_drafts": "drafts",
                 "vllm:spec_decode_num_draft_tokens": "draft_tokens",
                 "vllm:spec_decode_num_accepted_tokens": "accepted"}
PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos"


def speculative_config(k: int, method: str) -> dict[str, object] | None:
    """vLLM's ``speculative_config`` for K draft tokens with ``method`` (None: K = 0)."""
    if k == 0:
        return None
    config: dict[str, object] = {"method": method, "num_speculative_tokens": k}
    if method in NGRAM_METHODS:
        config.update(prompt_lookup_min=2, prompt_lookup_max=3)
    return config


def spec_figures(metrics: Sequence[object]) -> dict[str, object]:
    """vLLM's speculative-decoding counters (summed over engines) from
    ``LLM.get_metrics()``; a counter vLLM did not report is absent."""
    out: dict[str, object] = {}
    per_pos: list[int] = []
    for m in metrics:
        name = str(getattr(m, "name", ""))
        if name in SPEC_COUNTERS:
            key = SPEC_COUNTERS[name]
            out[key] = int(str(out.get(key, 0))) + int(getattr(m, "value", 0))
        elif name == PER_POSITION:
            values = [int(v) for v in getattr(m, "values", ())]
            per_pos += [0] * (len(values) - len(per_pos))
            for i, v in enumerate(values):
                per_pos[i] += v
    if per_pos:
        out["accepted_per_position"] = per_pos
    return out


def run(spec: dict[str, object], out: Path) -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    k = int(str(spec.get("spec", 0)))
    extra: dict[str, object] = {}
    spec_config = speculative_config(k, str(spec.get("spec_method", "ngram_gpu")))
    if spec_config is not None:
        extra.update(speculative_config=spec_config, disable_log_stats=False)
    llm = LLM(model=str(spec["model"]), load_format="dummy", skip_tokenizer_init=True,
              dtype=str(spec["dtype"]), pipeline_parallel_size=int(str(spec["pp_size"])),
              distributed_executor_backend="mp", enforce_eager=True,
              max_model_len=int(str(spec["max_model_len"])),
              max_num_seqs=int(str(spec["max_num_seqs"])),
              max_num_batched_tokens=int(str(spec["max_model_len"])),
              seed=int(str(spec["seed"])), **extra)
    params = SamplingParams(temperature=0.0, max_tokens=int(str(spec["max_tokens"])),
                            ignore_eos=True, detokenize=False)
    prompt_ids = spec["prompts"]
    assert isinstance(prompt_ids, list)
    prompts = [TokensPrompt(prompt_token_ids=list(p)) for p in prompt_ids]
    tokens: list[list[list[int]]] = []
    seconds: list[float] = []
    calls_at: list[tuple[float, float]] = []
    result: dict[str, object] = {"tokens": tokens, "generate_s": seconds, "calls_at": calls_at}
    calls, idle_s = int(str(spec["calls"])), float(str(spec.get("idle_s", 0)))
    try:
        for call in range(calls):
            if call and idle_s:
                time.sleep(idle_s)  # the engine alive, no request
            t0, wall = time.perf_counter(), time.time()
            outputs = llm.generate(prompts, params, use_tqdm=False)
            seconds.append(time.perf_counter() - t0)
            calls_at.append((wall, time.time()))
            tokens.append([list(o.outputs[0].token_ids) for o in outputs])
    except Exception as e:  # what the caller of generate saw (a fault run expects one)
        result["error"] = caller_error(e)
        result["ended_at"] = time.time()
        out.write_text(json.dumps(result))
        raise
    if spec_config is not None:
        result["spec"] = spec_figures(list(llm.get_metrics()))
    out.write_text(json.dumps(result))


def caller_error(e: BaseException) -> dict[str, str]:
    """An exception as the caller saw it: its type, its first line, and the
    whole text of it and of its causes (where a rank may be named)."""
    parts, seen = [], set()
    cur: BaseException | None = e
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        parts.append(f"{type(cur).__name__}: {cur}")
        parts += [str(n) for n in getattr(cur, "__notes__", ())]
        cur = cur.__cause__ or cur.__context__
    lines = str(e).splitlines()
    return {"type": f"{type(e).__module__}.{type(e).__qualname__}",
            "first_line": lines[0] if lines else "", "text": "\n".join(parts)}


if __name__ == "__main__":
    run(json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[2]))
