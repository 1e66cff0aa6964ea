"""ppsync's handlers behind vLLM's ``PPHandler`` interfaces.

- ``handler``: :class:`PPHandler`, what every interface shares;
  ``PPHandler(..., interface=...)`` builds the interface's class;
- ``v0_32``, ``v0_33``: one class per vLLM interface;
- ``versions``: installed vLLM version -> interface -> class;
- ``checks``: the interfaces' argument checks;
- ``plugin``: the vLLM plugin (``PPSYNC_VLLM=1``) that binds the installed
  version's class in vLLM's model runner.
"""

from ppsync.compat.vllm.handler import PPHandler, SampledOutputs
from ppsync.compat.vllm.v0_32 import PPHandler032
from ppsync.compat.vllm.v0_33 import PPHandler033

__all__ = ["PPHandler", "PPHandler032", "PPHandler033", "SampledOutputs"]
