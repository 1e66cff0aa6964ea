"""``ppsync sglang-check``: a real SGLang engine at pp_size 2 on a tiny
dummy-weight Llama, without and with ppsync's guard (ppsync.compat.sglang),
side by side: tokens, the plugin on every stage, a killed or stopped last
stage, a perturbed stage's view (docs/operations.md, "SGLang check")."""

from ppsync.checks.sglang.check import CASES, SglangCheckOptions, run_case, run_check

__all__ = ["CASES", "SglangCheckOptions", "run_case", "run_check"]
