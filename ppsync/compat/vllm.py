"""A drop-in for vLLM's ``PPHandler``: its method names and return values, on
top of :class:`ppsync.core.handler.TokenPath`.

Only the interface carries over from vLLM. Per engine step, every rank calls,
in this order:

1. :meth:`PPHandler.get_prev_sampled_outputs` and applies what it returns
   (non-last ranks: step T-D's tokens; the last rank: None);
2. :meth:`PPHandler.on_req_idx_freed` for each freed request slot;
3. then, with the step's ``input_batch``: non-last ranks
   :meth:`PPHandler.receive`; the last rank :meth:`PPHandler.broadcast` and,
   when K > 0, :meth:`PPHandler.broadcast_drafts`.

With K > 0 the last rank's tokens and drafts travel as one frame (docs/design.md
§4): ``broadcast`` checks the step and holds it, ``broadcast_drafts`` sends it
with the drafts. A held step never outlives its engine step: if the drafts do
not come, it goes without them (the frame header says so, and receivers
scatter no drafts for it) at the next call that starts a step
(``get_prev_sampled_outputs`` or ``broadcast``) or at :meth:`PPHandler.close`.
The last rank should therefore call ``get_prev_sampled_outputs`` every step,
as the order above says: with D = 1 a receiver consumes step T's frame at the
start of step T+1, before the last rank reaches its next ``broadcast``.

An ``input_batch`` is any object with the attributes that
:func:`ppsync.core.batch.batch_view_of` reads: ``num_reqs``, ``idx_mapping_np``,
``num_computed_tokens_np``, ``num_scheduled_tokens``, ``prefill_len_np`` and,
optionally, ``max_seq_len_np`` and ``is_prefilling_np``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from types import TracebackType

import numpy as np
import torch
import torch.distributed as dist

from ppsync.core.aux_relay import AuxRelay
from ppsync.core.batch import batch_view_of, validate_batch
from ppsync.core.checks import check_draft_table
from ppsync.core.groups import token_group
from ppsync.core.handler import CallNames, PreparedStep, TokenPath
from ppsync.errors import BatchError, ConfigError, ProtocolError
from ppsync.schemas.config import SyncConfig

__all__ = ["PPHandler"]

VLLM_NAMES = CallNames(consume="get_prev_sampled_outputs", post="receive", publish="broadcast")


class PPHandler:
    """One rank's token path behind vLLM's ``PPHandler`` interface.

    ``group`` is the PP group (None: the default group, passed explicitly
    here, never looked up further down). The handler makes its own token
    group with the same ranks (rule 6 of docs/design.md), collectively over the PP
    group's members only, so every member must construct its handler at the
    same point. ``ring_depth`` is D (None: pp_size); ``timeout_s`` bounds
    every wait. Bad values raise :class:`ConfigError` before any collective.
    """

    def __init__(
        self,
        max_num_reqs: int,
        num_speculative_steps: int,
        device: torch.device,
        *,
        group: dist.ProcessGroup | None = None,
        ring_depth: int | None = None,
        timeout_s: float = 60.0,
    ) -> None:
        if not dist.is_initialized():
            raise ConfigError(
                "torch.distributed is not initialized: call init_process_group() before "
                "building a PPHandler"
            )
        pp_group = dist.group.WORLD if group is None else group
        if pp_group is None:  # pragma: no cover - is_initialized() says there is one
            raise ConfigError("no default process group; pass group= explicitly")
        config = SyncConfig.build(
            pp_size=dist.get_world_size(pp_group),
            max_num_reqs=max_num_reqs,
            num_speculative_steps=num_speculative_steps,
            ring_depth=ring_depth,
            timeout_s=timeout_s,
        )
        try:
            self.device = torch.device(device)
        except (RuntimeError, TypeError) as e:
            raise ConfigError(f"device = {device!r} is not a torch device ({e})") from None
        self.config = config
        self._path = TokenPath(config, token_group(pp_group, timeout_s=config.timeout_s),
                               names=VLLM_NAMES)
        self._aux = AuxRelay()
        self._held: PreparedStep | None = None  # last rank, K > 0: waiting for its drafts

    # -- shared ---------------------------------------------------------------

    @property
    def is_last_rank(self) -> bool:
        """True on the rank that samples (group rank pp_size - 1)."""
        return self._path.is_last

    @property
    def token_path(self) -> TokenPath:
        """The underlying token path (for diagnostics; do not drive it directly)."""
        return self._path

    def on_req_idx_freed(self, req_idx: int) -> None:
        """Request slot ``req_idx`` was freed (finish, abort, preemption)."""
        self._path.free(req_idx)

    def get_prev_sampled_outputs(
        self, draft_tokens_to_update: torch.Tensor | None = None  # [max_num_reqs, K]
    ) -> dict[str, torch.Tensor] | None:
        """Start a step. Non-last ranks: release the step received D steps ago,
        as ``{"sampled_tokens": [num_reqs, L] int64, "num_sampled": [num_reqs]
        int32, "num_rejected": [num_reqs] int32, "idx_mapping": [num_reqs]
        int64, -1 = excluded}`` on ``device``; drafts of kept rows go into
        ``draft_tokens_to_update[slot]``. None for an empty ring slot or when
        every row is excluded. The last rank: sends a step still held for its
        drafts, without them, and returns None."""
        if self._path.is_last:
            self._check_open("get_prev_sampled_outputs")
            self._flush_held()
            return None
        # called again without receive() between: the step before had an empty
        # schedule and its ring slot stays empty (vLLM skips sample_tokens then)
        released = self._path.consume(draft_tokens_to_update)
        if released is None:
            return None
        return {k: v.to(self.device) for k, v in released.as_vllm_dict().items()}

    # -- non-last ranks -------------------------------------------------------

    def receive(self, input_batch: object) -> bool:
        """Post this step's receive. True iff every row needs a sample; False
        when some row does not, or the step has no transfer at all."""
        view = batch_view_of(input_batch)
        try:
            needed = self._path.post(view)
        except ProtocolError:
            if self._path.closed:
                raise
            raise ProtocolError(
                "receive() without get_prev_sampled_outputs() before it; each step is "
                "get_prev_sampled_outputs(), then receive()"
            ) from None
        return view.num_reqs > 0 and needed == view.num_reqs

    # -- last rank --------------------------------------------------------------

    def broadcast(
        self,
        sampled_token_ids: torch.Tensor,  # [num_reqs, w] int64, 1 <= w <= L, -1 padded
        num_sampled: torch.Tensor,  # [num_reqs] int32
        num_rejected: torch.Tensor,  # [num_reqs] int32
        input_batch: object,
    ) -> None:
        """Check this step's sampler outputs (all before any collective) and
        send them; with K > 0, hold them for :meth:`broadcast_drafts`."""
        self._flush_held()  # the previous step's drafts did not come
        step, _ = self._path.prepare(
            batch_view_of(input_batch), sampled_token_ids, num_sampled, num_rejected
        )
        if self.config.num_speculative_steps == 0:
            self._path.send(step)
        else:
            self._held = _detached(step)

    def broadcast_drafts(
        self,
        draft_tokens: torch.Tensor,  # [max_num_reqs, K] int64, indexed by request slot
        input_batch: object,
    ) -> None:
        """Send the held step with ``draft_tokens[idx_mapping]`` as one frame.

        Raises :class:`BatchError` when K = 0, the table is malformed, or
        ``input_batch`` is not the held step's batch; :class:`ProtocolError`
        when no :meth:`broadcast` of this step holds a frame. On any error the
        held step stays held and goes without drafts when the next step starts."""
        self._check_open("broadcast_drafts")
        self._path.require_role("broadcast_drafts", last=True)
        table_np = check_draft_table(
            draft_tokens,
            max_num_reqs=self.config.max_num_reqs,
            num_drafts=self.config.num_speculative_steps,
        )
        held = self._held
        if held is None:
            raise ProtocolError(
                "broadcast_drafts() without a held step: call broadcast() first in the same "
                "step, and broadcast_drafts() at most once per step"
            )
        view = batch_view_of(input_batch)
        validate_batch(view, self.config.max_num_reqs)
        idx_np = held.view.idx_mapping_np
        if view.num_reqs != held.view.num_reqs:
            raise BatchError(
                f"input_batch.num_reqs = {view.num_reqs} but the held step has "
                f"num_reqs = {held.view.num_reqs}; broadcast_drafts() takes broadcast()'s batch"
            )
        if not np.array_equal(view.idx_mapping_np, idx_np):
            row = int(np.argmax(view.idx_mapping_np != idx_np))
            raise BatchError(
                f"input_batch.idx_mapping[{row}] = {int(view.idx_mapping_np[row])} but the "
                f"held step has {int(idx_np[row])}; broadcast_drafts() takes broadcast()'s batch"
            )
        drafts_np = table_np[idx_np]  # [num_reqs, K], a gather: owns its memory
        self._held = None  # cleared first: a failed send is never retried
        self._path.send(held, drafts_np)

    # -- aux hidden states (rule 7) --------------------------------------------

    def configure_aux_hidden_state_relay(self, keys: Sequence[str]) -> None:
        """Relay the intermediate tensors named ``keys`` from the upstream
        stage to the next (an empty sequence turns relaying off)."""
        self._aux.configure(keys)

    def relay_aux_hidden_states(
        self, intermediate_tensors: object | None, output_intermediate_tensors: object
    ) -> Mapping[str, torch.Tensor]:
        """``output_intermediate_tensors`` plus the configured keys taken from
        ``intermediate_tensors`` (mappings, or objects with ``.tensors``).
        Unchanged output when no keys are configured; :class:`BatchError`
        naming the key when one is missing upstream or there is no upstream."""
        return self._aux.relay(intermediate_tensors, output_intermediate_tensors)

    # -- lifecycle ----------------------------------------------------------------

    def close(self, *, drain: bool = True) -> None:
        """Send a step still held for its drafts (without them), wait (bounded)
        for every transfer in flight, and stop. Without ``drain``, abandon
        both. Idempotent; any later call raises :class:`ProtocolError`."""
        if self._path.closed:
            return
        flushed = False
        try:
            if drain:
                self._flush_held()
            flushed = True
        finally:
            self._held = None
            self._path.close(drain=drain and flushed)

    def __enter__(self) -> PPHandler:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        # On an error, peers may be gone: do not wait for them.
        self.close(drain=exc_type is None)

    # -- internals ----------------------------------------------------------------

    def _flush_held(self) -> None:
        held, self._held = self._held, None
        if held is not None:
            self._path.send(held)  # no drafts: the header's has-drafts flag stays clear

    def _check_open(self, op: str) -> None:
        if self._path.closed:
            raise ProtocolError(f"{op}() after close()")


def _detached(step: PreparedStep) -> PreparedStep:
    """``step`` with its own copies of every array: on CPU, ``prepare`` reads
    the caller's tensors and batch arrays without copying, and an engine may
    refill those buffers before a held step is sent."""
    v = step.view
    view = replace(
        v,
        idx_mapping_np=v.idx_mapping_np.copy(),
        num_computed_tokens_np=v.num_computed_tokens_np.copy(),
        num_scheduled_tokens_np=v.num_scheduled_tokens_np.copy(),
        prefill_len_np=v.prefill_len_np.copy(),
        max_seq_len_np=None if v.max_seq_len_np is None else v.max_seq_len_np.copy(),
        is_prefilling_np=None if v.is_prefilling_np is None else v.is_prefilling_np.copy(),
    )
    return replace(
        step,
        view=view,
        need_np=step.need_np.copy(),
        tokens_np=step.tokens_np.copy(),
        num_sampled_np=step.num_sampled_np.copy(),
        num_rejected_np=step.num_rejected_np.copy(),
    )
