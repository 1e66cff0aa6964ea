"""vLLM 0.31-0.32's ``PPHandler`` interface: the receiver scatters drafts into
the engine's ``[max_num_reqs, K]`` table; ``broadcast_drafts`` takes that
table and the step's ``input_batch``; every step is L = K + 1 wide (vLLM
pads the tokens with 0, ppsync with -1: vLLM reads the first num_sampled
only). A final prefill chunk whose sampled token reaches ``max_seq_len``
needs no sample (when ``max_seq_len_np`` is set); on XPU,
``VLLM_XPU_PP_MICROBATCH=0`` makes the ring one step deep. 0.30
(ppsync.compat.vllm.v0_30) has the same calls without the cap or the
switch."""

from __future__ import annotations

import torch

from ppsync.compat.vllm.arg_checks import NOT_GIVEN, check_held_batch, other_interface
from ppsync.compat.vllm.handler import PPHandler, SampledOutputs


class PPHandler032(PPHandler):
    """vLLM 0.31-0.32's interface (see the module docstring)."""

    interface = "0.32"
    xpu_microbatch_switch = True

    def get_prev_sampled_outputs(
        self, draft_tokens_to_update: torch.Tensor | None = None  # [max_num_reqs, K]
    ) -> SampledOutputs | None:
        """Start a step; non-last ranks: step T-D's outputs, its kept rows'
        drafts scattered into ``draft_tokens_to_update[slot]`` (K = 0: a
        ``[max_num_reqs, 0]`` table, nothing scattered)."""
        started = self._start(draft_tokens_to_update)
        return None if started is None else started[0]

    def receive(self, input_batch: object, recv_drafts: object = NOT_GIVEN) -> bool:
        """Post this step's receive (``input_batch`` only). True iff every
        row needs a sample."""
        if recv_drafts is not NOT_GIVEN:
            raise other_interface(self.interface, "0.33", "receive(input_batch, recv_drafts)",
                                  "receive() takes input_batch only")
        return self._post(self._batch(input_batch), None, None)

    def broadcast(
        self,
        sampled_token_ids: torch.Tensor,  # [num_reqs, w] int64, 1 <= w <= L, -1 padded
        num_sampled: torch.Tensor,  # [num_reqs] int32
        num_rejected: torch.Tensor,  # [num_reqs] int32
        input_batch: object,
    ) -> None:
        """Check this step's sampler outputs (before any collective) and send
        them; with K > 0, hold them for :meth:`broadcast_drafts`."""
        self._broadcast(self._batch(input_batch), sampled_token_ids, num_sampled,
                        num_rejected, None)

    def broadcast_drafts(
        self,
        draft_tokens: torch.Tensor,  # [max_num_reqs, K] by request slot
        input_batch: object = NOT_GIVEN,
    ) -> None:
        """Send the held step with ``draft_tokens[idx_mapping]`` as one
        frame; ``input_batch`` must be the held step's. BatchError when K = 0,
        the table is malformed, or the batch is another; ProtocolError without
        a held step. On any error the held step stays held and goes without
        drafts when the next step starts."""
        self._check_open("broadcast_drafts")
        self._path.require_role("broadcast_drafts", last=True)
        if input_batch is NOT_GIVEN:
            raise other_interface(self.interface, "0.33", "broadcast_drafts(draft_tokens)",
                                  "broadcast_drafts() takes (draft_tokens [max_num_reqs, K], "
                                  "input_batch)")
        codec = self._path.codec
        table = codec.check_draft_table(draft_tokens)
        held = self._held_step()
        check_held_batch(held, input_batch, self.config.max_num_reqs)
        self._send_held(codec.gather_drafts(table, held.facts.idx))
