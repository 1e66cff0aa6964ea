"""``make gpu-check``: the device path checked on a GPU machine, one row a
check (docs/operations.md, "GPU check").

- check.py: the table, its bounds and summary; ``python3 -m
  ppsync.checks.gpu.check`` runs it;
- step_costs.py: per-step timing of each scheme (row e);
- workload_checks.py: rows a-e; stream_checks.py: f-i;
  failure_checks.py: j-l; capture_check.py: m; carrier_checks.py: n-p.

Each check runs in a fresh process of its own (ppsync.harness.fresh). On a
machine without CUDA the tests run the same checks dry on CPU tensors.
"""
