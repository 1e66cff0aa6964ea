"""``ppsync vllm-check``: what a user runs before switching to ppsync's vLLM
handler. It runs the installed vLLM twice at pipeline_parallel_size 2 (or
``--pp-size``) on a small dummy model, with speculative decoding where
``--spec K`` asks for it, once with vLLM's own ``PPHandler`` and once with ppsync's
plugin, and reports which handler each worker built, whether the tokens are
identical, vLLM's acceptance counters, and per rank how long the handler's
calls took.

- check.py: the two runs (child processes) and the exit status;
- engine.py: one vLLM run (the child);
- worker_hooks.py: loaded in every vLLM process of a run (recording, the
  per-tensor seed, the Triton stand-in on CPU, the CPU work-arounds for
  speculative decoding);
- report.py: the comparison and the printed report (no vLLM needed);
- faults.py: a worker killed or stopped (--fault kill-last, stop-last,
  kill-first); healthy.py: their healthy twins, which must never be a fault
  (--fault slow-last, idle); node_faults.py: a host's (--nodes 2).
"""

from ppsync.checks.vllm.check import VllmCheckOptions, run_check

__all__ = ["VllmCheckOptions", "run_check"]
