"""A drop-in for vLLM's ``PPHandler`` (Model Runner V2): what every interface
shares, on top of :class:`ppsync.core.path.token_path.TokenPath`.

Only the interface carries over from vLLM. Each of vLLM's handler interfaces
is one subclass of :class:`PPHandler` (ppsync.compat.vllm.v0_23, v0_25,
v0_30, v0_32, v0_33, v0_34_cpu), stating its own signatures, widths, drafts
and need rule (ppsync.compat.vllm.need_rules), and registers the interface
it serves; ppsync.compat.vllm.versions maps vLLM releases to interfaces.
``PPHandler(..., interface=...)`` builds the interface's class (None: the
installed vLLM's); a call in another interface's shape raises
:class:`ProtocolError` naming both. Per engine step every rank calls
``get_prev_sampled_outputs``, ``on_req_idx_freed`` for each freed slot,
then ``receive`` (non-last ranks) or ``broadcast`` and, with drafts,
``broadcast_drafts`` (the last rank); an empty schedule stops after the first.

With K > 0 the last rank's tokens and drafts travel as one frame: the
step is held from ``broadcast`` to ``broadcast_drafts``, and goes without
drafts if they do not come (ppsync.compat.vllm.held). ``set_disabled``
switches the handler off and on (ppsync.compat.vllm.calls).

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
from typing import Any, ClassVar, Literal, NotRequired, TypedDict

import torch
import torch.distributed as dist

from ppsync.compat.vllm.arg_checks import NOT_GIVEN, check_empty_table, detached
from ppsync.compat.vllm.aux_relay import AuxRelay, AuxRelayCalls
from ppsync.compat.vllm.calls import HANDLER_CALLS, guarded
from ppsync.compat.vllm.held import HeldStep
from ppsync.compat.vllm.need_rules import final_prefill_cap_view
from ppsync.compat.vllm.settings import handler_path
from ppsync.compat.vllm.versions import (
    Interface,
    Runner,
    microbatching_off,
    resolve_interface,
)
from ppsync.core.codec import StepDrafts, default_codec
from ppsync.core.codec.steps import PreparedStep
from ppsync.core.frame.rows import ReleasedStep, SampledStep
from ppsync.core.path.names import CallNames
from ppsync.core.path.token_path import TokenPath
from ppsync.core.rules import BatchView
from ppsync.core.wire.board import FailureBoard
from ppsync.errors import ConfigError, PPSyncError, ProtocolError
from ppsync.schemas.config import (
    DEFAULT_SILENT_S,
    DEFAULT_TIMEOUT_S,
    CarrierName,
    CodecName,
    CpuKernelsName,
    DeviceKernelsName,
    EmulatedName,
    SyncConfig,
)

__all__ = ["HANDLER_CALLS", "PPHandler", "SampledOutputs", "handler_class"]

class SampledOutputs(TypedDict):
    """What :meth:`PPHandler.get_prev_sampled_outputs` returns on a non-last
    rank: step T-D's outputs, on the handler's device."""

    sampled_tokens: torch.Tensor  # [num_reqs, w] int64, -1 padded; w = L, or 0.33's step width
    num_sampled: torch.Tensor  # [num_reqs] int32
    num_rejected: torch.Tensor  # [num_reqs] int32
    idx_mapping: torch.Tensor  # [num_reqs] int64 (0.23-0.29: int32), -1 = excluded row
    draft_tokens: NotRequired[torch.Tensor | None]  # 0.33 only: [num_reqs, K] int64 or None

VLLM_NAMES = CallNames(consume="get_prev_sampled_outputs", post="receive", publish="broadcast")


class PPHandler(AuxRelayCalls):
    """One rank's token path behind vLLM's ``PPHandler`` interface.

    ``group`` is the PP group (None: the default group, passed explicitly
    here, never looked up further down). The handler makes its own token
    group with the same ranks (rule 6 of docs/design.md) the way vLLM makes
    its groups: every world rank creates every PP group's token group, in
    one order, so every world rank must construct its handler at the same
    point (vLLM's workers all do); ``pp_groups``: every PP group of the world
    (None: vLLM's PP groups, derived from the world size and ``group``'s ranks,
    ppsync.core.wire.groups.strided_groups). ``ring_depth`` is D (None: pp_size, or what
    :meth:`default_ring_depth` says); ``timeout_s`` bounds one wait for a
    live peer, ``silent_s`` how long a peer's heartbeat may stop (SyncConfig's);
    ``interface``: the vLLM interface served (see ppsync.compat.vllm.versions;
    None: the installed vLLM's), which picks the subclass this call builds;
    ``board``: where ranks post failures ("group", the default: in the token
    group's own store; None: no board); ``codec``: None picks the device codec
    for a non-CPU device or with ``emulate``; ``carrier``: how device frames
    travel (SyncConfig.carrier); ``cpu_kernels``: the host path's kernels
    (SyncConfig.cpu_kernels); ``device_kernels``: the device path's
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
        for name in HANDLER_CALLS:
            call = cls.__dict__.get(name)
            if call is not None and not getattr(call, "_ppsync_guarded", False):
                setattr(cls, name, guarded(name, call))
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
        if codec is None:
            codec = default_codec(self.device, emulated=emulate is not None)
        config = SyncConfig.build(
            pp_size=dist.get_world_size(pp_group),
            max_num_reqs=max_num_reqs,
            num_speculative_steps=num_speculative_steps,
            ring_depth=ring_depth,
            timeout_s=timeout_s,
            silent_s=silent_s,
            codec=codec,
            carrier=carrier,
            cpu_kernels=cpu_kernels,
            device_kernels=device_kernels,
        )
        self.config = config
        self._path = handler_path(config, self.device, pp_group, pp_groups, board, emulate,
                                  VLLM_NAMES)
        self._aux = AuxRelay()
        self._held = HeldStep()  # last rank, K > 0: a step waiting for its drafts
        self._disabled = False
        self._deferred: PPSyncError | None = None  # a flush's error, raised at the next call
        if self._path.is_last and self.sends_drafts and config.num_speculative_steps > 0:
            self._path.on_tick = self._flush_if_step_ended

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

    def set_disabled(self, disabled: bool) -> None:
        """Switch the handler off (True) or on (False), as vLLM's own
        (its warm-up runs synthetic steps with it off). Off, it issues
        nothing and returns what vLLM's own handler returns then:
        ``get_prev_sampled_outputs`` None, ``receive`` whether every row
        needs a sample (decided on the host, as when on), ``broadcast`` and
        ``broadcast_drafts`` None; freed slots are still counted. A step
        held for its drafts is sent first. Every rank switches at the same
        steps (vLLM's warm-up runs on every rank), so the ring stays the
        same on all of them."""
        if not isinstance(disabled, bool):
            raise ConfigError(f"set_disabled({disabled!r}): disabled must be a bool")
        with self._path.watcher.engine_call():
            if disabled and not self._path.closed:
                self._flush_held()
            self._disabled = disabled

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
        # the record is built here, at the edge: vLLM's calls keep their shape
        sampled = SampledStep(sampled_token_ids, num_sampled, num_rejected, None, width)
        step, _ = self._path.prepare(view, sampled)
        if self.config.num_speculative_steps == 0 or not self.sends_drafts:
            self._path.send(step)
        else:
            self._held.hold(detached(step))

    def _held_step(self) -> PreparedStep:
        self._check_open("broadcast_drafts")
        self._path.require_role("broadcast_drafts", last=True)
        held = self._held.step
        if held is None:
            raise ProtocolError(
                "broadcast_drafts() without a held step: call broadcast() first in the same "
                "step, and broadcast_drafts() at most once per step"
            )
        return held

    def _send_held(self, drafts: StepDrafts) -> None:
        """Send the held step with its [num_reqs, K] drafts; cleared first:
        a failed send is never retried."""
        held = self._held.take()
        assert held is not None
        self._path.send(held, drafts)

    def _flush_if_step_ended(self) -> None:
        """The watcher's round, while no handler call runs (last rank, K > 0):
        send a held step without drafts once its engine step ended
        (ppsync.compat.vllm.held), unless the send would wait (then at the
        next round); its error is raised at the engine's next call."""
        path = self._path
        if not self._held.step_ended() or not all(
                path.completion.ended(w) for w in path.works_before_issue()):
            return
        try:
            self._flush_held()
        except PPSyncError as e:  # the engine's next call raises it
            self._deferred = e

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
            self._held.take()
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
        held = self._held.take()
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
