"""The device codec on a CUDA device: the same bytes as the host codec, and
packing, checking and a sent step's verdict without any host sync. Skipped
without CUDA; ``make gpu-check`` runs the multi-rank checks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ppsync.core import SampledStep
from ppsync.core.codec.device_kernels import device_kernels_for, interpreting, triton_error
from ppsync.core.frame import BufferPool, FrameView, slot_need_words
from ppsync.core.frame.device_frames import V_NUM_SAMPLED, DeviceFrames
from ppsync.core.frame.numpy_frames import NumpyFrames
from ppsync.core.rules.checks import value_bounds
from ppsync.core.wire.platform import platform_for
from ppsync.schemas.config import SyncConfig

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(),
                       reason="needs a CUDA device (torch.cuda.is_available() is False)"),
]


@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_cuda_frame_equals_host_frame_without_a_host_sync(kernels: str) -> None:
    if kernels == "triton" and (triton_error() is not None or interpreting()):
        pytest.skip("compiled Triton kernels need triton and TRITON_INTERPRET=0")
    dev = torch.device("cuda", 0)
    config = SyncConfig.build(pp_size=2, max_num_reqs=16, num_speculative_steps=2,
                              device_kernels=kernels)
    host, codec, p = NumpyFrames(config), DeviceFrames(config, dev), platform_for(dev)
    ks = device_kernels_for(config, codec)
    assert ks.name == kernels
    idx = np.array([3, 9, 1], dtype=np.int64)
    computed = np.array([10, 11, 1 << 40], dtype=np.int64)
    need = np.array([True, True, False])
    facts = np.stack([slot_need_words(idx, need), computed.astype(np.int64)])
    view = FrameView(5, 3, host.facts_digest(facts), slot_need_words(idx, need), computed)
    tokens_np = np.array([[1 << 62, 2, 3], [4, 5, -1], [7, -1, -1]], dtype=np.int64)
    ns_np, nr_np = np.array([3, 2, 1], dtype=np.int32), np.array([0, 1, 2], dtype=np.int32)
    drafts_np = np.arange(6, dtype=np.int64).reshape(3, 2)
    hbuf = BufferPool(host).take(3)
    hbuf.numpy()[:] = 0
    host.pack(hbuf.numpy(), view, tokens_np, ns_np, nr_np, drafts_np)
    tokens, ns, nr, drafts = (torch.from_numpy(a).to(dev)
                              for a in (tokens_np, ns_np, nr_np, drafts_np))
    staging = p.host_buffer(codec.layout.staging.words)
    codec.stage(staging.numpy(), view, codec.layout.flags(True), value_bounds(3, 2, 3))
    stage_dev = torch.empty_like(staging, device=dev)
    verdict = torch.zeros(1, dtype=torch.int64, device=dev)
    buf = torch.zeros(host.words(3), dtype=torch.int64, device=dev)
    side = p.new_stream()
    p.wait_stream(side, p.current_stream())
    torch.cuda.set_sync_debug_mode("error")
    try:
        with p.use(side):
            stage_dev.copy_(staging, non_blocking=True)
            ks.pack(buf, stage_dev, 3, SampledStep(tokens, ns, nr, drafts), verdict)
            staging[-1:].copy_(verdict, non_blocking=True)
            event = p.record_event(side)
        p.wait_event(p.current_stream(), event)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    event.synchronize()
    assert int(staging[-1]) == 0
    assert np.array_equal(buf.cpu().numpy(), hbuf.numpy())
    stage_dev.copy_(staging)
    ks.pack(torch.zeros_like(buf), stage_dev, 3, SampledStep(tokens, ns + 3, nr), verdict)
    assert int(verdict.cpu()[0]) == V_NUM_SAMPLED
