"""The benchmarks behind ``ppsync bench``: the token path against raw
broadcasts and vLLM's scheme, lockstep and pipelined, on local gloo ranks.

- *vLLM's scheme*: how vLLM's own ``PPHandler`` carries sampled tokens
  today, tokens, counts and drafts each in its own blocking broadcast
  (ppsync.bench.vllm_scheme makes its host calls);
- *the bench targets*: the ratios and per-step costs the bench reads its
  tables against, each with its limit (ppsync.bench.runner,
  ppsync.bench.dispatches); printed under the tables, never asserted.
"""
