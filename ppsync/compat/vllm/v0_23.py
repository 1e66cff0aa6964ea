"""vLLM 0.23-0.24's ``PPHandler`` interface: ``get_prev_sampled_outputs()``
(no argument) returns 4 keys; ``receive(input_batch)``; ``broadcast(...)``;
no drafts travel (no ``broadcast_drafts``), so with K > 0 each frame goes at
``broadcast``. Tokens are received L = K + 1 wide (vLLM sends them as the
sampler made them and receives L wide; ppsync pads to L with -1). A row
needs a sample only while ``max(num_computed, prefill_len) + 1 <
max_seq_len``, decode rows too (ppsync.compat.vllm.need_rules), so
``max_seq_len_np`` is required. The released ``idx_mapping`` is int32, as
these releases return it (built from an int32 array)."""

from __future__ import annotations

import torch

from ppsync.compat.vllm.arg_checks import NOT_GIVEN, other_interface
from ppsync.compat.vllm.handler import PPHandler, SampledOutputs
from ppsync.compat.vllm.need_rules import any_row_cap_view
from ppsync.errors import ProtocolError


class PPHandler023(PPHandler):
    """vLLM 0.23-0.24's interface (see the module docstring)."""

    interface = "0.23"
    sends_drafts = False
    idx_mapping_dtype = torch.int32
    _view = staticmethod(any_row_cap_view)

    def get_prev_sampled_outputs(
        self, draft_tokens_to_update: torch.Tensor | None = None
    ) -> SampledOutputs | None:
        """Start a step; non-last ranks: step T-D's outputs (4 keys). Takes
        no argument."""
        if draft_tokens_to_update is not None:
            raise other_interface(self.interface, "0.30",
                                  "get_prev_sampled_outputs(draft_tokens_to_update)",
                                  "get_prev_sampled_outputs() takes no argument: no drafts "
                                  "travel")
        started = self._start(None)
        return None if started is None else started[0]

    def receive(self, input_batch: object, recv_drafts: object = NOT_GIVEN) -> bool:
        """Post this step's receive (``input_batch`` only). True iff every
        row needs a sample."""
        if recv_drafts is not NOT_GIVEN:
            raise other_interface(self.interface, "0.33", "receive(input_batch, recv_drafts)",
                                  "receive() takes input_batch only")
        return self._post(self._batch(input_batch), False, None)

    def broadcast(
        self,
        sampled_token_ids: torch.Tensor,  # [num_reqs, w] int64, 1 <= w <= L
        num_sampled: torch.Tensor,  # [num_reqs] int32
        num_rejected: torch.Tensor,  # [num_reqs] int32
        input_batch: object,
    ) -> None:
        """Check this step's sampler outputs (before any collective) and
        send them; receivers get them L wide, -1 padded."""
        self._broadcast(self._batch(input_batch), sampled_token_ids, num_sampled,
                        num_rejected, None)

    def broadcast_drafts(self, draft_tokens: torch.Tensor,
                         input_batch: object = NOT_GIVEN) -> None:
        """Not part of this interface: ProtocolError."""
        raise ProtocolError(
            f"broadcast_drafts() is not in vLLM {self.interface}'s PPHandler interface "
            f"(interface = {self.interface!r}), where no drafts travel: vLLM sends drafts "
            "from 0.30 on")
