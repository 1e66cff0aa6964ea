"""vLLM 0.34's ``PPHandler`` of the standalone CPU runner (non-x86 CPUs
without Triton; ``vllm/v1/worker/cpu/pp_utils.py``): built as
``PPHandler(max_num_reqs, device)``, no speculative decoding (K = 0, tokens
1 wide); ``get_prev_sampled_outputs()`` returns 4 keys;
``receive(input_batch)``. Its need rule is 0.31's (a final prefill chunk at
the cap needs no sample, when ``max_seq_len_np`` is set). vLLM's own handler
there is synchronous; ppsync's is not, and the runner's calls are the same.
The x86 CPU and XPU runners subclass the GPU runner and use the GPU
interface."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch
import torch.distributed as dist

from ppsync.compat.vllm.need_rules import final_prefill_cap_view
from ppsync.compat.vllm.v0_23 import PPHandler023
from ppsync.core.wire.board import FailureBoard
from ppsync.schemas.config import (
    DEFAULT_SILENT_S,
    DEFAULT_TIMEOUT_S,
    CarrierName,
    CodecName,
    CpuKernelsName,
    DeviceKernelsName,
    EmulatedName,
)


class PPHandler034Cpu(PPHandler023):
    """vLLM 0.34's CPU runner interface (see the module docstring)."""

    interface = "0.34-cpu"
    runner = "cpu"
    idx_mapping_dtype = torch.int64  # 0.23's calls, but this release returns int64
    _view = staticmethod(final_prefill_cap_view)

    def __init__(
        self,
        max_num_reqs: int,
        device: torch.device,
        *,
        group: dist.ProcessGroup | None = None,
        ring_depth: int | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        silent_s: float = DEFAULT_SILENT_S,
        interface: str | None = None,
        board: FailureBoard | Literal["group"] | None = "group",
        codec: CodecName | None = None,
        carrier: CarrierName = "host",
        cpu_kernels: CpuKernelsName = "auto",
        device_kernels: DeviceKernelsName = "auto",
        pp_groups: Sequence[Sequence[int]] | None = None,
        emulate: EmulatedName | None = None,
    ) -> None:
        super().__init__(max_num_reqs, 0, device, group=group, ring_depth=ring_depth,
                         timeout_s=timeout_s, silent_s=silent_s, interface=interface,
                         board=board, codec=codec, carrier=carrier,
                         cpu_kernels=cpu_kernels, device_kernels=device_kernels,
                         pp_groups=pp_groups, emulate=emulate)
