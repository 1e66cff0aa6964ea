"""One vLLM engine run of ``ppsync vllm-check`` (a child process of the check).

``python -m ppsync.harness.vllm_check.engine SPEC.json OUT.json`` builds
vLLM's offline ``LLM`` with the model, pipeline size and settings of
SPEC, generates greedily for SPEC's prompts (token ids: the model has no
tokenizer) ``repeat`` times, and writes the tokens of every call and each
call's duration to OUT. Which handler vLLM builds is decided by the
environment the check gives this process (``PPSYNC_VLLM``), and recorded by
the worker hooks, not here. vLLM starts its workers with ``spawn``, which
imports this module again in them: everything runs under ``__main__``.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path


def run(spec: dict[str, object], out: Path) -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=str(spec["model"]), load_format="dummy", skip_tokenizer_init=True,
              dtype=str(spec["dtype"]), pipeline_parallel_size=int(str(spec["pp_size"])),
              distributed_executor_backend="mp", enforce_eager=True,
              max_model_len=int(str(spec["max_model_len"])),
              max_num_seqs=int(str(spec["max_num_seqs"])),
              max_num_batched_tokens=int(str(spec["max_model_len"])),
              seed=int(str(spec["seed"])))
    params = SamplingParams(temperature=0.0, max_tokens=int(str(spec["max_tokens"])),
                            ignore_eos=True, detokenize=False)
    prompt_ids = spec["prompts"]
    assert isinstance(prompt_ids, list)
    prompts = [TokensPrompt(prompt_token_ids=list(p)) for p in prompt_ids]
    tokens, seconds = [], []
    for _ in range(int(str(spec["repeat"]))):
        t0 = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        seconds.append(time.perf_counter() - t0)
        tokens.append([list(o.outputs[0].token_ids) for o in outputs])
    out.write_text(json.dumps({"tokens": tokens, "generate_s": seconds}))


if __name__ == "__main__":
    run(json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[2]))
