"""Adapters from other engines' interfaces to ppsync's token path.

``ppsync.compat.vllm.PPHandler`` keeps vLLM's ``PPHandler`` method names and
return values on top of :class:`ppsync.core.handler.TokenPath`.
"""

from ppsync.compat.vllm import PPHandler

__all__ = ["PPHandler"]
