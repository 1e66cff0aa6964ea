"""vLLM 0.25-0.29's ``PPHandler`` interface: 0.23's calls, widths and need
rule (ppsync.compat.vllm.v0_23). vLLM 0.25 added one thing: on XPU the last
rank synchronizes the main stream before ``broadcast``. ppsync's XPU
platform does that for every interface (rule 6 of docs/design.md), 0.23's
included, so the two classes differ in name only: each release maps to its
own interface."""

from __future__ import annotations

from ppsync.compat.vllm.v0_23 import PPHandler023


class PPHandler025(PPHandler023):
    """vLLM 0.25-0.29's interface (see the module docstring)."""

    interface = "0.25"
