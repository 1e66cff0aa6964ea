"""Adapters from other engines' interfaces to ppsync's token path.

``ppsync.compat.vllm.PPHandler`` keeps the method names and return values of
vLLM's ``PPHandler`` (its 0.32 and 0.33 interfaces) on top of
:class:`ppsync.core.handler.TokenPath`; ``ppsync.compat.vllm_plugin`` is the
vLLM plugin that makes vLLM build it (``PPSYNC_VLLM=1``).
"""

from ppsync.compat.vllm import PPHandler, SampledOutputs

__all__ = ["PPHandler", "SampledOutputs"]
