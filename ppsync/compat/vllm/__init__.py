"""ppsync's handlers behind vLLM's ``PPHandler`` interfaces.

- ``handler``: :class:`PPHandler`, what every interface shares;
  ``PPHandler(..., interface=...)`` builds the interface's class (each class
  registers the interface it serves: importing this package imports every one);
- ``v0_23``, ``v0_25``, ``v0_30``, ``v0_32``, ``v0_33``, ``v0_34_cpu``: one
  class per vLLM interface;
- ``need_rules``: each release's rule for which rows need a sample;
- ``versions``: installed vLLM version -> interface (it knows no class);
- ``checks``: the interfaces' argument checks;
- ``plugin``: the vLLM plugin (``PPSYNC_VLLM=1``) that binds the installed
  version's classes in vLLM's model runners (GPU and CPU).
"""

from ppsync.compat.vllm.handler import PPHandler, SampledOutputs
from ppsync.compat.vllm.v0_23 import PPHandler023
from ppsync.compat.vllm.v0_25 import PPHandler025
from ppsync.compat.vllm.v0_30 import PPHandler030
from ppsync.compat.vllm.v0_32 import PPHandler032
from ppsync.compat.vllm.v0_33 import PPHandler033
from ppsync.compat.vllm.v0_34_cpu import PPHandler034Cpu

__all__ = ["PPHandler", "PPHandler023", "PPHandler025", "PPHandler030", "PPHandler032",
           "PPHandler033", "PPHandler034Cpu", "SampledOutputs"]
