"""Adapters from other engines' interfaces to ppsync's token path.

``ppsync.compat.vllm`` keeps the method names and return values of vLLM's
``PPHandler``, one class per vLLM interface (0.23 to 0.34, and the 0.34 CPU
runner's), on top of :class:`ppsync.core.path.token_path.TokenPath`;
``ppsync.compat.vllm.plugin`` is the vLLM plugin that makes vLLM build it
(``PPSYNC_VLLM=1``).
"""

from ppsync.compat.vllm import PPHandler, SampledOutputs

__all__ = ["PPHandler", "SampledOutputs"]
