"""A drop-in for vLLM's ``PPHandler`` (Model Runner V2): its method names and
return values, on top of :class:`ppsync.core.handler.TokenPath`.

Only the interface carries over from vLLM. One class serves vLLM 0.32's and
0.33's interfaces (see :mod:`ppsync.compat.vllm_interface`), chosen by
``interface=`` or from the installed vLLM; a call in the other interface's
shape raises :class:`ProtocolError` naming both. Per engine step, every rank
calls, in this order:

1. :meth:`PPHandler.get_prev_sampled_outputs` and applies what it returns
   (non-last ranks: step T-D's tokens; the last rank: None);
2. :meth:`PPHandler.on_req_idx_freed` for each freed request slot (a request
   finished, preempted, or re-added as a streaming input);
3. then, with the step's ``input_batch``: non-last ranks
   :meth:`PPHandler.receive`; the last rank :meth:`PPHandler.broadcast` and,
   when K > 0 and the step proposes drafts, :meth:`PPHandler.broadcast_drafts`.

A step with an empty schedule stops after 1. on every rank (vLLM skips
``sample_tokens``): its ring slot stays empty, nothing is sent.

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
optionally, ``max_seq_len_np`` and ``is_prefilling_np`` (vLLM: ``np.intp``
slots, ``np.int32`` counts, ``max_seq_len_np`` only when the batch holds a
prefill); interface 0.33 also reads ``num_draft_tokens``.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import TracebackType
from typing import Literal, NotRequired, TypedDict, TypeVar

import torch
import torch.distributed as dist

from ppsync.compat.vllm_checks import (
    NOT_GIVEN,
    check_empty_table,
    check_held_batch,
    check_recv_drafts,
    detached,
    other_interface,
    rebuilt_like,
    step_width,
)
from ppsync.compat.vllm_interface import Interface, relay_keys_of, resolve_interface
from ppsync.core.aux_relay import AuxRelay
from ppsync.core.batch import batch_view_of
from ppsync.core.checks import check_draft_table, check_draft_table_meta, check_step_drafts
from ppsync.core.groups import token_group
from ppsync.core.handler import TokenPath
from ppsync.core.liveness import FailureBoard
from ppsync.core.platform import platform_for
from ppsync.core.steps import CallNames, PreparedStep
from ppsync.errors import BatchError, ConfigError, ProtocolError
from ppsync.schemas.config import SyncConfig

__all__ = ["PPHandler", "SampledOutputs"]

T = TypeVar("T")


class SampledOutputs(TypedDict):
    """What :meth:`PPHandler.get_prev_sampled_outputs` returns on a non-last
    rank: step T-D's outputs, on the handler's device."""

    sampled_tokens: torch.Tensor  # [num_reqs, w] int64, -1 padded; w = L, or 0.33's step width
    num_sampled: torch.Tensor  # [num_reqs] int32
    num_rejected: torch.Tensor  # [num_reqs] int32
    idx_mapping: torch.Tensor  # [num_reqs] int64, -1 = excluded row
    draft_tokens: NotRequired[torch.Tensor | None]  # 0.33 only: [num_reqs, K] int64 or None

VLLM_NAMES = CallNames(consume="get_prev_sampled_outputs", post="receive", publish="broadcast")


class PPHandler:
    """One rank's token path behind vLLM's ``PPHandler`` interface.

    ``group`` is the PP group (None: the default group, passed explicitly
    here, never looked up further down). The handler makes its own token
    group with the same ranks (rule 6 of docs/design.md), over gloo because frames
    are host buffers, collectively over the PP group's members only, so every
    member must construct its handler at the same point. ``ring_depth`` is D
    (None: pp_size); ``timeout_s`` bounds every wait; ``interface`` is
    ``"0.32"``, ``"0.33"`` or None (the installed vLLM's; "0.32" without
    vLLM); ``board``: where ranks post failures, so that every rank learns of a
    desync or a lost peer that one rank saw ("group", the default: in the
    token group's own store; None: no board). Bad values raise :class:`ConfigError`
    before any collective.
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
        interface: str | None = None,
        board: FailureBoard | Literal["group"] | None = "group",
        codec: Literal["host", "device"] | None = None,
    ) -> None:
        self.interface: Interface = resolve_interface(interface)
        if not dist.is_initialized():
            raise ConfigError(
                "torch.distributed is not initialized: call init_process_group() before "
                "building a PPHandler"
            )
        pp_group = dist.group.WORLD if group is None else group
        if pp_group is None:  # pragma: no cover - is_initialized() says there is one
            raise ConfigError("no default process group; pass group= explicitly")
        try:
            self.device = torch.device(device)
        except (RuntimeError, TypeError) as e:
            raise ConfigError(f"device = {device!r} is not a torch device ({e})") from None
        if codec is None:  # a GPU engine must not sync per step: the device codec there
            codec = "host" if self.device.type == "cpu" else "device"
        config = SyncConfig.build(
            pp_size=dist.get_world_size(pp_group),
            max_num_reqs=max_num_reqs,
            num_speculative_steps=num_speculative_steps,
            ring_depth=ring_depth,
            timeout_s=timeout_s,
            codec=codec,
        )
        self.config = config
        # the device codec's frames live on the engine's device: its backend
        # (nccl on CUDA, xccl on XPU); host frames go over gloo
        platform = platform_for(self.device)
        backend = platform.backend if codec == "device" else "gloo"
        tokens = token_group(pp_group, timeout_s=config.timeout_s, backend=backend)
        self._path = TokenPath(config, tokens, board=board, names=VLLM_NAMES,
                               device=self.device if codec == "device" else None,
                               platform=platform if codec == "device" else None)
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
        """Request slot ``req_idx`` was freed (finish, abort, preemption, a
        streaming request re-added)."""
        self._path.free(req_idx)

    def get_prev_sampled_outputs(
        self, draft_tokens_to_update: torch.Tensor | None = None  # 0.32: [max_num_reqs, K]
    ) -> SampledOutputs | None:
        """Start a step. Non-last ranks: release the step received D steps
        ago (see :class:`SampledOutputs`); None for an empty ring slot or when
        every row is excluded. Interface 0.32 scatters the drafts of kept rows
        into ``draft_tokens_to_update[slot]`` (with K = 0 the table is
        ``[max_num_reqs, 0]`` and nothing is scattered); 0.33 takes no table
        and returns the drafts as ``draft_tokens``. The last rank: sends a
        step still held for its drafts, without them, and returns None."""
        if self.interface == "0.33" and draft_tokens_to_update is not None:
            raise other_interface(self.interface,
                "get_prev_sampled_outputs(draft_tokens_to_update)",
                "get_prev_sampled_outputs() takes no draft table; the drafts come back as "
                "'draft_tokens'")
        if self._path.is_last:
            self._check_open("get_prev_sampled_outputs")
            self._flush_held()
            return None
        table = draft_tokens_to_update
        if table is not None and self.config.num_speculative_steps == 0:
            check_empty_table(table, self.config.max_num_reqs)
            table = None  # [max_num_reqs, 0]: nothing to scatter
        # called again without receive() between: the step before had an empty
        # schedule and its ring slot stays empty (vLLM skips sample_tokens then)
        released = self._path.consume(table)
        if released is None:
            return None
        d = self.device
        out = SampledOutputs(
            sampled_tokens=released.sampled_tokens.to(d),
            num_sampled=released.num_sampled.to(d),
            num_rejected=released.num_rejected.to(d),
            idx_mapping=released.idx_mapping.to(d),
        )
        if self.interface == "0.33":
            drafts = released.draft_tokens
            out["draft_tokens"] = None if drafts is None else drafts.to(d)
        return out

    # -- non-last ranks -------------------------------------------------------

    def receive(self, input_batch: object, recv_drafts: object = NOT_GIVEN) -> bool:
        """Post this step's receive. True iff every row needs a sample; False
        when some row does not, or the step has no transfer at all.

        Interface 0.33: ``recv_drafts`` says whether the last rank calls
        ``broadcast_drafts`` this step; a frame that disagrees raises
        :class:`DesyncError` at its consume (on every rank, with a board)."""
        expect: bool | None = None
        width: int | None = None
        if self.interface == "0.32":
            if recv_drafts is not NOT_GIVEN:
                raise other_interface(self.interface, "receive(input_batch, recv_drafts)",
                                            "receive() takes input_batch only")
        else:
            if recv_drafts is NOT_GIVEN:
                raise other_interface(self.interface, "receive(input_batch)",
                                            "receive() takes (input_batch, recv_drafts)")
            expect = check_recv_drafts(recv_drafts, self.config.num_speculative_steps)
            width = step_width(input_batch, self.config.sample_width)
        view = batch_view_of(input_batch)
        # order errors name vLLM's calls: the token path has VLLM_NAMES
        needed = self._path.post(view, expect_drafts=expect, sample_width=width)
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
        send them; with K > 0, hold them for :meth:`broadcast_drafts`.
        Interface 0.33: the tokens are at most the step's width wide (1 when
        ``input_batch.num_draft_tokens == 0``), and receivers get that width."""
        self._flush_held()  # the previous step's drafts did not come
        width = None
        if self.interface == "0.33":
            width = step_width(input_batch, self.config.sample_width)
        if width is not None:
            got = getattr(sampled_token_ids, "shape", (0, 0))
            if len(got) == 2 and got[1] > width:
                raise BatchError(
                    f"sampled_token_ids.shape[1] = {got[1]} exceeds this step's sample width "
                    f"{width} (interface 0.33: L = K + 1 = {self.config.sample_width} only "
                    "when input_batch.num_draft_tokens > 0, else 1)")
        step, _ = self._path.prepare(batch_view_of(input_batch), sampled_token_ids,
                                     num_sampled, num_rejected, sample_width=width)
        if self.config.num_speculative_steps == 0:
            self._path.send(step)
        else:
            self._held = detached(step)

    def broadcast_drafts(
        self,
        draft_tokens: torch.Tensor,  # 0.32: [max_num_reqs, K] by request slot; 0.33: [num_reqs, K]
        input_batch: object = NOT_GIVEN,  # 0.32 only
    ) -> None:
        """Send the held step with its drafts as one frame: interface 0.32
        gathers ``draft_tokens[idx_mapping]`` from the table and checks that
        ``input_batch`` is the held step's; 0.33 takes them gathered.

        Raises :class:`BatchError` when K = 0, the drafts are malformed, or
        ``input_batch`` is not the held step's batch; :class:`ProtocolError`
        when no :meth:`broadcast` of this step holds a frame. On any error the
        held step stays held and goes without drafts when the next step starts."""
        self._check_open("broadcast_drafts")
        self._path.require_role("broadcast_drafts", last=True)
        if self.interface == "0.32" and input_batch is NOT_GIVEN:
            raise other_interface(self.interface,
                "broadcast_drafts(draft_tokens)",
                "broadcast_drafts() takes (draft_tokens [max_num_reqs, K], input_batch)")
        if self.interface == "0.33" and input_batch is not NOT_GIVEN:
            raise other_interface(self.interface,
                "broadcast_drafts(draft_tokens, input_batch)",
                "broadcast_drafts() takes the drafts [num_reqs, K] only, already gathered")
        K = self.config.num_speculative_steps
        on_device = self._path.codec.on_device
        table_np = None
        if self.interface == "0.32" and not on_device:
            table_np = check_draft_table(draft_tokens, max_num_reqs=self.config.max_num_reqs,
                                         num_drafts=K)
        if self.interface == "0.32" and on_device:
            check_draft_table_meta(draft_tokens, max_num_reqs=self.config.max_num_reqs,
                                   num_drafts=K, device=self._path.platform.device)
        held = self._held
        if held is None:
            raise ProtocolError(
                "broadcast_drafts() without a held step: call broadcast() first in the same "
                "step, and broadcast_drafts() at most once per step"
            )
        if on_device:
            drafts: torch.Tensor = draft_tokens
            if self.interface == "0.32":
                check_held_batch(held, input_batch, self.config.max_num_reqs)
                # gathered on the device (rule 4's rows); the slots are host facts
                idx = torch.from_numpy(held.facts.idx)
                drafts = draft_tokens.index_select(0, idx.to(draft_tokens.device,
                                                             non_blocking=True))
            self._held = None
            self._path.send(held, drafts)  # the meta checks of [num_reqs, K] run there
            return
        if table_np is None:
            drafts_np = check_step_drafts(draft_tokens, num_reqs=held.view.num_reqs,
                                          num_drafts=K)
        else:
            check_held_batch(held, input_batch, self.config.max_num_reqs)
            drafts_np = table_np[held.facts.idx]  # [num_reqs, K], owns its memory
        self._held = None  # cleared first: a failed send is never retried
        self._path.send(held, drafts_np)

    # -- aux hidden states (rule 7) --------------------------------------------

    def configure_aux_hidden_state_relay(self, model: torch.nn.Module | Sequence[str]) -> None:
        """Relay the named intermediate tensors from the upstream stage to
        the next: given vLLM's model, the keys vLLM's EAGLE3 helper names for
        it on this rank; or the keys themselves (empty: relaying off)."""
        keys = relay_keys_of(model) if isinstance(model, torch.nn.Module) else model
        self._aux.configure(keys)

    def relay_aux_hidden_states(
        self, intermediate_tensors: object | None, output_intermediate_tensors: T
    ) -> T:
        """``output_intermediate_tensors`` plus the configured keys taken from
        ``intermediate_tensors``, as the type it was given (a mapping, or an
        object with ``.tensors`` such as vLLM's IntermediateTensors, rebuilt).
        The output itself when no keys are configured; :class:`BatchError`
        naming the key when one is missing upstream or there is no upstream."""
        merged = self._aux.relay(intermediate_tensors, output_intermediate_tensors)
        if not self._aux.keys:
            return output_intermediate_tensors
        return rebuilt_like(output_intermediate_tensors, merged)

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
