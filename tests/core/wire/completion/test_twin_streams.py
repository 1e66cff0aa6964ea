"""The CPU twin's stand-in streams (ppsync.core.wire.completion.twin_streams)."""

from __future__ import annotations

import torch

from ppsync.core.wire.completion.twin_streams import TwinStream


def test_a_side_stream_runs_its_work_in_the_submitters_inference_mode() -> None:
    """vLLM steps under torch.inference_mode(): a side stream's in-place
    update of a tensor made there must run as on the submitting thread
    (a CUDA stream has no thread of its own), not fail on the stand-in's."""
    side = TwinStream("side", main=False)
    try:
        with torch.inference_mode():
            buf = torch.zeros(4, dtype=torch.int64)  # an inference tensor

            def fill() -> None:
                buf.fill_(7)  # in place, on the side stream

            side.submit(fill)
            event = side.record_event()
        event.synchronize()
        side.raise_error()
        assert buf.tolist() == [7] * 4
        seen: list[bool] = []
        side.submit(lambda: seen.append(torch.is_inference_mode_enabled()))
        side.record_event().synchronize()
        assert seen == [False]
    finally:
        side.stop()
