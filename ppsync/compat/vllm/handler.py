"""A drop-in for vLLM's ``PPHandler`` (Model Runner V2): what every interface
shares, on top of :class:`ppsync.core.path.token_path.TokenPath`.

Only the interface carries over from vLLM. Each of vLLM's handler interfaces
is one subclass of :class:`PPHandler` (ppsync.compat.vllm.v0_23, v0_25,
v0_30, v0_32, v0_33, v0_34_cpu), stating its own signatures, widths, drafts
and need rule (ppsync.compat.vllm.need_rules), and registers the interface
it serves; ppsync.compat.vllm.versions maps vLLM releases to interfaces.
``PPHandler(..., interface=...)`` builds the
interface's class (None: the installed vLLM's); a call in another
interface's shape raises :class:`ProtocolError` naming both. Per engine
step, every rank calls, in this order:

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
:func:`ppsync.core.rules.batch_view_of` reads: ``num_reqs``, ``idx_mapping_np``,
``num_computed_tokens_np``, ``num_scheduled_tokens``, ``prefill_len_np`` and,
optionally, ``max_seq_len_np`` and ``is_prefilling_np`` (vLLM: ``np.intp``
slots, ``np.int32`` counts, ``max_seq_len_np`` only when the batch holds a
prefill); interface 0.33 also reads ``num_draft_tokens``; 0.23 and 0.25
require ``max_seq_len_np``.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import TracebackType
from typing import Any, ClassVar, Literal, NotRequired, TypedDict, TypeVar

import torch
import torch.distributed as dist

from ppsync.compat.vllm.aux_relay import AuxRelay
from ppsync.compat.vllm.checks import NOT_GIVEN, check_empty_table, detached, rebuilt_like
from ppsync.compat.vllm.need_rules import final_prefill_cap_view
from ppsync.compat.vllm.settings import check_twin
from ppsync.compat.vllm.versions import (
    Interface,
    Runner,
    microbatching_off,
    relay_keys_of,
    resolve_interface,
)
from ppsync.core.codec import StepDrafts, default_codec, frames_home
from ppsync.core.codec.records import PreparedStep
from ppsync.core.codec.released import ReleasedStep
from ppsync.core.path.names import CallNames
from ppsync.core.path.token_path import TokenPath
from ppsync.core.rules import BatchView
from ppsync.core.wire.board import FailureBoard
from ppsync.core.wire.completion import emulate as emulate_group
from ppsync.core.wire.groups import strided_groups, token_group_among
from ppsync.core.wire.platform import platform_for
from ppsync.errors import ConfigError, ProtocolError
from ppsync.schemas.config import DEFAULT_TIMEOUT_S, SyncConfig

__all__ = ["PPHandler", "SampledOutputs", "handler_class"]

T = TypeVar("T")


class SampledOutputs(TypedDict):
    """What :meth:`PPHandler.get_prev_sampled_outputs` returns on a non-last
    rank: step T-D's outputs, on the handler's device."""

    sampled_tokens: torch.Tensor  # [num_reqs, w] int64, -1 padded; w = L, or 0.33's step width
    num_sampled: torch.Tensor  # [num_reqs] int32
    num_rejected: torch.Tensor  # [num_reqs] int32
    idx_mapping: torch.Tensor  # [num_reqs] int64 (0.23-0.29: int32), -1 = excluded row
    draft_tokens: NotRequired[torch.Tensor | None]  # 0.33 only: [num_reqs, K] int64 or None

VLLM_NAMES = CallNames(consume="get_prev_sampled_outputs", post="receive", publish="broadcast")


class PPHandler:
    """One rank's token path behind vLLM's ``PPHandler`` interface.

    ``group`` is the PP group (None: the default group, passed explicitly
    here, never looked up further down). The handler makes its own token
    group with the same ranks (rule 6 of docs/design.md) the way vLLM makes
    its groups: every world rank creates every PP group's token group, in
    one order, so every world rank must construct its handler at the same
    point (vLLM's workers all do); ``pp_groups``: every PP group of the world
    (None: vLLM's PP groups, derived from the world size and ``group``'s ranks,
    ppsync.core.wire.groups.strided_groups). ``ring_depth`` is D (None: pp_size, or what
    :meth:`default_ring_depth` says); ``timeout_s`` bounds every wait;
    ``interface``: the vLLM interface served (see ppsync.compat.vllm.versions;
    None: the installed vLLM's), which picks the subclass this call builds;
    ``board``: where ranks post failures ("group", the default: in the token
    group's own store; None: no board); ``codec``: None picks the device codec
    for a non-CPU device or with ``emulate``; ``host_kernels``: the host path's kernels
    (SyncConfig.host_kernels); ``device_kernels``: the device path's
    (SyncConfig.device_kernels); ``emulate``: "nccl" | "xccl", the token group
    behaves as that backend's (the CPU twin: CPU tensors, the device codec).
    Bad values raise :class:`ConfigError` before any collective.
    """

    interface: ClassVar[str | None] = None
    """The interface a subclass serves (None: this base, which picks one)."""
    runner: ClassVar[Runner] = "gpu"
    """The vLLM model runner that builds this interface's handler."""
    sends_drafts: ClassVar[bool] = True
    """The last rank sends drafts with K > 0 (vLLM 0.30 on); otherwise every
    frame goes at ``broadcast``, without drafts."""
    xpu_microbatch_switch: ClassVar[bool] = False
    """On XPU, ``VLLM_XPU_PP_MICROBATCH=0`` makes the ring one step deep
    (vLLM 0.31 on), unless ``ring_depth`` is given."""
    idx_mapping_dtype: ClassVar[torch.dtype] = torch.int64
    """The dtype of the ``idx_mapping`` that ``get_prev_sampled_outputs``
    returns: the release's own (its consumers may be kernels compiled for
    it)."""
    _view = staticmethod(final_prefill_cap_view)
    """The batch view whose need mask is the release's (need_rules)."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.__dict__.get("interface") is not None:  # a class that serves one
            _SERVES[cls.__dict__["interface"]] = cls

    def __new__(cls, *args: Any, interface: str | None = None, **kwargs: Any) -> PPHandler:
        if cls.interface is None:  # PPHandler(...) itself: the interface's class
            cls = handler_class(resolve_interface(interface))
        return object.__new__(cls)

    def __init__(
        self,
        max_num_reqs: int,
        num_speculative_steps: int,
        device: torch.device,
        *,
        group: dist.ProcessGroup | None = None,
        ring_depth: int | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        interface: str | None = None,
        board: FailureBoard | Literal["group"] | None = "group",
        codec: Literal["host", "device"] | None = None,
        host_kernels: Literal["auto", "numba", "numpy"] = "auto",
        device_kernels: Literal["auto", "triton", "torch"] = "auto",
        pp_groups: Sequence[Sequence[int]] | None = None,
        emulate: Literal["nccl", "xccl"] | None = None,
    ) -> None:
        if interface is not None and resolve_interface(interface) != self.interface:
            raise ConfigError(f"interface = {interface!r}, but {type(self).__name__} serves "
                              f"{self.interface!r}")
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
        if ring_depth is None:
            ring_depth = self.default_ring_depth(self.device)
        if codec is None:  # the twin carries device frames, as NCCL does
            codec = "device" if emulate is not None else default_codec(self.device)
        config = SyncConfig.build(
            pp_size=dist.get_world_size(pp_group),
            max_num_reqs=max_num_reqs,
            num_speculative_steps=num_speculative_steps,
            ring_depth=ring_depth,
            timeout_s=timeout_s,
            codec=codec,
            host_kernels=host_kernels,
            device_kernels=device_kernels,
        )
        self.config = config
        # the device codec's frames live on the engine's device: its backend
        # (nccl on CUDA, xccl on XPU); host frames go over gloo
        if emulate is not None:  # before any group is made
            check_twin(config, emulate, self.device)
        backend, platform = frames_home(codec, platform_for(self.device))
        if pp_groups is None:
            pp_groups = strided_groups(dist.get_world_size(),
                                       dist.get_process_group_ranks(pp_group))
        tokens = token_group_among(pp_group, pp_groups, timeout_s=config.timeout_s,
                                   backend=backend)
        if emulate is not None:  # the same completion choice as every path's
            emulate_group(tokens, emulate)
        self._path = TokenPath(config, tokens, board=board, names=VLLM_NAMES,
                               platform=platform)
        self._aux = AuxRelay()
        self._held: PreparedStep | None = None  # last rank, K > 0: waiting for its drafts

    @classmethod
    def default_ring_depth(cls, device: torch.device) -> int | None:
        """The ring depth D when none is given: 1 on XPU with
        ``VLLM_XPU_PP_MICROBATCH=0`` where the interface reads that switch;
        otherwise None (pp_size)."""
        if cls.xpu_microbatch_switch and device.type == "xpu" and microbatching_off():
            return 1
        return None

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

    # -- each interface's calls (its subclass states their shapes) ----------------

    def get_prev_sampled_outputs(
        self, draft_tokens_to_update: torch.Tensor | None = None
    ) -> SampledOutputs | None:
        """Start a step. Non-last ranks: release the step received D steps
        ago; the last rank: send a step still held for its drafts, without
        them, and return None."""
        raise NotImplementedError

    def receive(self, input_batch: object, recv_drafts: object = NOT_GIVEN) -> bool:
        """Post this step's receive. True iff every row needs a sample."""
        raise NotImplementedError

    def broadcast(self, sampled_token_ids: torch.Tensor, num_sampled: torch.Tensor,
                  num_rejected: torch.Tensor, input_batch: object) -> None:
        """Check this step's sampler outputs and send them (K > 0: hold them
        for :meth:`broadcast_drafts`)."""
        raise NotImplementedError

    def broadcast_drafts(self, draft_tokens: torch.Tensor,
                         input_batch: object = NOT_GIVEN) -> None:
        """Send the held step with its drafts as one frame."""
        raise NotImplementedError

    # -- what the interfaces' calls are made of ------------------------------------

    def _start(self, table: torch.Tensor | None) -> tuple[SampledOutputs, ReleasedStep] | None:
        """The start of a step: the last rank sends a held step (no drafts)
        and gets None; a receiver releases step T-D, scattering drafts of
        kept rows into ``table`` ([max_num_reqs, K]; K = 0: ignored), and
        gets its outputs on this handler's device with the released step."""
        if self._path.is_last:
            self._check_open("get_prev_sampled_outputs")
            self._flush_held()
            return None
        if table is not None and self.config.num_speculative_steps == 0:
            check_empty_table(table, self.config.max_num_reqs)
            table = None  # [max_num_reqs, 0]: nothing to scatter
        # called again without receive() between: the step before had an empty
        # schedule and its ring slot stays empty (vLLM skips sample_tokens then)
        released = self._path.consume(table)
        if released is None:
            return None
        d = self.device
        return SampledOutputs(
            sampled_tokens=released.sampled_tokens.to(d),
            num_sampled=released.num_sampled.to(d),
            num_rejected=released.num_rejected.to(d),
            idx_mapping=released.idx_mapping.to(d, self.idx_mapping_dtype),
        ), released

    def _batch(self, input_batch: object) -> BatchView:
        """``input_batch`` as the view whose need mask is this release's."""
        return self._view(input_batch, self.config.max_num_reqs)

    def _post(self, view: BatchView, expect: bool | None, width: int | None) -> bool:
        # order errors name vLLM's calls: the token path has VLLM_NAMES
        needed = self._path.post(view, expect_drafts=expect, sample_width=width)
        return view.num_reqs > 0 and needed == view.num_reqs

    def _broadcast(self, view: BatchView, sampled_token_ids: torch.Tensor,
                   num_sampled: torch.Tensor, num_rejected: torch.Tensor,
                   width: int | None) -> None:
        """Check a step (all before any collective); send it, or with K > 0
        where the interface sends drafts, hold it for them."""
        self._flush_held()  # the previous step's drafts did not come
        step, _ = self._path.prepare(view, sampled_token_ids, num_sampled, num_rejected,
                                     sample_width=width)
        if self.config.num_speculative_steps == 0 or not self.sends_drafts:
            self._path.send(step)
        else:
            self._held = detached(step)

    def _held_step(self) -> PreparedStep:
        self._check_open("broadcast_drafts")
        self._path.require_role("broadcast_drafts", last=True)
        held = self._held
        if held is None:
            raise ProtocolError(
                "broadcast_drafts() without a held step: call broadcast() first in the same "
                "step, and broadcast_drafts() at most once per step"
            )
        return held

    def _send_held(self, drafts: StepDrafts) -> None:
        """Send the held step with its [num_reqs, K] drafts; cleared first:
        a failed send is never retried."""
        held, self._held = self._held, None
        assert held is not None
        self._path.send(held, drafts)

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


_SERVES: dict[str, type[PPHandler]] = {}
"""Each interface's class, by the interface it serves: a class registers
itself where it is defined (ppsync.compat.vllm imports every one)."""


def handler_class(interface: Interface) -> type[PPHandler]:
    """The class that serves ``interface``."""
    return _SERVES[interface]
