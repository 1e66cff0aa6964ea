"""vLLM 0.30's ``PPHandler`` interface: the calls, widths and drafts of
0.31-0.32's (ppsync.compat.vllm.v0_32), but every row that produces a sample
needs it (no ``max_seq_len`` cap), and no XPU microbatching switch."""

from __future__ import annotations

from ppsync.compat.vllm.need_rules import uncapped_view
from ppsync.compat.vllm.v0_32 import PPHandler032


class PPHandler030(PPHandler032):
    """vLLM 0.30's interface (see the module docstring)."""

    interface = "0.30"
    xpu_microbatch_switch = False
    _view = staticmethod(uncapped_view)
