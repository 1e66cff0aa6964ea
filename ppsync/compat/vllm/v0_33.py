"""vLLM 0.33-0.34's ``PPHandler`` interface: ``get_prev_sampled_outputs()``
returns the drafts under a fifth key; ``receive(input_batch, recv_drafts)``;
``broadcast_drafts(draft_tokens)`` takes them gathered, ``[num_reqs, K]``;
a step is L wide when ``input_batch.num_draft_tokens > 0``, else 1. Need
rule and XPU switch as 0.32's (ppsync.compat.vllm.v0_32)."""

from __future__ import annotations

import torch

from ppsync.compat.vllm.arg_checks import NOT_GIVEN, check_recv_drafts, other_interface, step_width
from ppsync.compat.vllm.handler import PPHandler, SampledOutputs
from ppsync.core.rules.checks import check_width_fits
from ppsync.errors import BatchError


class PPHandler033(PPHandler):
    """vLLM 0.33-0.34's interface (see the module docstring)."""

    interface = "0.33"
    xpu_microbatch_switch = True

    def get_prev_sampled_outputs(
        self, draft_tokens_to_update: torch.Tensor | None = None
    ) -> SampledOutputs | None:
        """Start a step; non-last ranks: step T-D's outputs, with its drafts
        ``[num_reqs, K]`` (None when the frame had none) as ``draft_tokens``.
        Takes no draft table."""
        if draft_tokens_to_update is not None:
            raise other_interface(self.interface, "0.32",
                                  "get_prev_sampled_outputs(draft_tokens_to_update)",
                                  "get_prev_sampled_outputs() takes no draft table; the drafts "
                                  "come back as 'draft_tokens'")
        started = self._start(None)
        if started is None:
            return None
        out, released = started
        drafts = released.draft_tokens
        out["draft_tokens"] = None if drafts is None else drafts.to(self.device)
        return out

    def receive(self, input_batch: object, recv_drafts: object = NOT_GIVEN) -> bool:
        """Post this step's receive; ``recv_drafts`` says whether the last
        rank calls ``broadcast_drafts`` this step (a frame that disagrees is a
        DesyncError at its consume, on every rank with a board)."""
        if recv_drafts is NOT_GIVEN:
            raise other_interface(self.interface, "0.32", "receive(input_batch)",
                                  "receive() takes (input_batch, recv_drafts)")
        expect = check_recv_drafts(recv_drafts, self.config.num_speculative_steps)
        width = step_width(input_batch, self.config.sample_width)
        return self._post(self._batch(input_batch), expect, width)

    def broadcast(
        self,
        sampled_token_ids: torch.Tensor,  # [num_reqs, w] int64, w <= the step's width
        num_sampled: torch.Tensor,  # [num_reqs] int32
        num_rejected: torch.Tensor,  # [num_reqs] int32
        input_batch: object,
    ) -> None:
        """Check this step's sampler outputs (before any collective) and send
        them; with K > 0, hold them for :meth:`broadcast_drafts`. The tokens
        are at most the step's width wide (1 when
        ``input_batch.num_draft_tokens == 0``), and receivers get that width."""
        width = step_width(input_batch, self.config.sample_width)
        shape: tuple[int, ...] = tuple(getattr(sampled_token_ids, "shape", ()))
        if len(shape) == 2:
            try:
                check_width_fits(shape[1], width)
            except BatchError as e:
                e.add_note(f"interface 0.33: L = K + 1 = {self.config.sample_width} only when "
                           "input_batch.num_draft_tokens > 0, else 1")
                raise
        self._broadcast(self._batch(input_batch), sampled_token_ids, num_sampled,
                        num_rejected, width)

    def broadcast_drafts(
        self,
        draft_tokens: torch.Tensor,  # [num_reqs, K], already gathered
        input_batch: object = NOT_GIVEN,
    ) -> None:
        """Send the held step with its drafts as one frame. BatchError when
        K = 0 or the drafts are malformed; ProtocolError without a held step.
        On any error the held step stays held and goes without drafts when
        the next step starts."""
        self._check_open("broadcast_drafts")
        self._path.require_role("broadcast_drafts", last=True)
        if input_batch is not NOT_GIVEN:
            raise other_interface(self.interface, "0.32",
                                  "broadcast_drafts(draft_tokens, input_batch)",
                                  "broadcast_drafts() takes the drafts [num_reqs, K] only, "
                                  "already gathered")
        held = self._held_step()
        self._send_held(self._path.codec.step_drafts(draft_tokens, held.view.num_reqs))
