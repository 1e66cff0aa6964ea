"""The AROUND hooks the SGLang plugin puts on ``SchedulerPPMixin``, and the
bounded receive they switch on.

Each hook takes SGLang's original function first, then SGLang's arguments
as SGLang passes them (positional or by name), calls the original once,
and adds only the guard's work around it (ppsync.compat.sglang.guard):

- ``_pp_send_dict_to_next_stage``: puts the sender's view of the message
  (a tuple of ints, under :data:`VIEW_KEY`) in the dict; SGLang sends its
  non-tensor entries in the pickled metadata it sends anyway, so no
  transfer is added.
- ``_pp_recv_typed_dict``: receives with every gloo wait bounded, takes the
  view out of the dict (SGLang never sees it) and checks it against the
  receiver's own view of the batch the message is for.
- ``_pp_send_recv_and_preprocess_output_tensors``: tells the two hooks
  above which batch an ``"output"`` message is for (the last stage sends
  ``mbs[next_first_rank_mb_id]``'s; every stage receives for
  ``mbs[next_mb_id]``; the other stages relay what they received, with the
  view they received it with).
- ``_pp_send_pyobj_to_next_stage``, ``_pp_recv_pyobj_from_prev_stage`` and
  ``Scheduler.ingest_requests`` (where a later stage receives the requests
  the previous one relays): their transfers bounded.

A transfer is bounded by :func:`bounded`, which the plugin puts in the
place of ``torch.distributed.irecv`` and ``isend`` (SGLang calls them by
attribute, at call time): while a hook of this module runs, a gloo work
they return is a :class:`BoundedWork`, whose ``wait()`` (SGLang's own, at
once for a receive, at the next step's commit for a send) waits through
the guard; any other call gets torch's own work. On a GPU the hidden
states travel on NCCL and stay SGLang's; their pickled metadata, which
goes first on gloo, is bounded.
"""

from __future__ import annotations

import sys
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from ppsync.compat.sglang.digest import KINDS, StepView
from ppsync.compat.sglang.guard import GuardOptions, SglangGuard
from ppsync.core.wire.transport import translate

__all__ = ["HOOKS", "RECEIVE", "SEND", "VIEW_KEY", "BoundedWork", "bounded", "guard_of"]

VIEW_KEY = "__ppsync_view__"
"""The tensor-dict entry that carries the sender's view."""
_GUARD_ATTR = "_ppsync_guard"
_RELAYS_KEPT = 16  # received output views kept for the relay (a few are in flight)

Original = Callable[..., Any]


class _Context(threading.local):
    guard: SglangGuard | None = None
    """The guard of the hooked transfer running on this thread (None: none)."""


_context = _Context()
_options: list[GuardOptions] = []  # read once per process, at the first guard
_gloo: dict[int, bool] = {}


def _arg(args: tuple[Any, ...], kwargs: dict[str, Any], index: int, name: str,
         default: Any = None) -> Any:
    if len(args) > index:
        return args[index]
    return kwargs.get(name, default)


def _is_gloo(group: Any) -> bool:
    key = id(group)
    if key not in _gloo:
        try:
            _gloo[key] = dist.get_backend(group) == "gloo"
        except (RuntimeError, ValueError):
            _gloo[key] = False
    return _gloo[key]


class _StageState:
    """What the hooks keep per stage beside the guard."""

    def __init__(self, guard: SglangGuard) -> None:
        self.guard = guard
        self.output_send_batch: Any = None
        self.output_recv_batch: Any = None
        self.relays: OrderedDict[int, StepView] = OrderedDict()


def _state(scheduler: Any) -> _StageState | None:
    """The stage's state, made at its first PP message; None outside a PP
    group of two stages or more."""
    state: _StageState | None = getattr(scheduler, _GUARD_ATTR, None)
    if state is not None:
        return state
    pp_group = scheduler.pp_group
    if pp_group.world_size < 2:
        return None
    if not _options:
        _options.append(GuardOptions.from_env())
    guard = SglangGuard(stage=pp_group.rank_in_group, pp_size=pp_group.world_size,
                        group=pp_group.cpu_group, options=_options[0])
    state = _StageState(guard)
    setattr(scheduler, _GUARD_ATTR, state)
    board = "in the PP group's store" if guard.board is not None else "none"
    print(f"ppsync: guard active on SGLang PP stage {guard.stage} of {pp_group.world_size} "
          f"(global rank {guard.global_rank}; timeout {guard.options.timeout_s:g} s, "
          f"view check {'on' if guard.options.check else 'off'}; failure board {board})",
          file=sys.stderr, flush=True)
    return state


def guard_of(scheduler: Any) -> SglangGuard | None:
    """The guard the hooks made for ``scheduler`` (None before its first
    PP message, or without PP)."""
    state: _StageState | None = getattr(scheduler, _GUARD_ATTR, None)
    return None if state is None else state.guard


class BoundedWork:
    """A gloo transfer's work whose ``wait()`` goes through the guard (torch
    lets a gloo work be waited on once: SGLang's one ``wait()`` is it)."""

    def __init__(self, work: dist.Work, guard: SglangGuard, peer: int, what: str) -> None:
        self._work = work
        self._guard = guard
        self._peer = peer
        self._what = what

    def wait(self, timeout: object = None) -> bool:
        g, peer = self._guard, self._peer
        g.wait(self._work, f"{self._what} PP stage {g.stage_of(peer)} (global rank {peer})",
               peer)
        return True

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


def bounded(real: Original, what: str) -> Original:
    """``torch.distributed.irecv`` (``what`` = "receive from") or ``isend``
    ("send to") as the plugin installs them: ``real``'s work, bounded while
    a hook's transfer runs on this thread; torch's own work otherwise."""

    def transfer(*args: Any, **kwargs: Any) -> Any:
        guard = _context.guard
        if guard is None:
            return real(*args, **kwargs)
        peer = _arg(args, kwargs, 1, "src" if what == RECEIVE else "dst")
        if not isinstance(peer, int) or not _is_gloo(_arg(args, kwargs, 2, "group")):
            return real(*args, **kwargs)
        try:  # gloo raises at the post too, when the peer's connection is already closed
            work = real(*args, **kwargs)
        except RuntimeError as e:
            name = f"{what} PP stage {guard.stage_of(peer)} (global rank {peer})"
            err = translate(e, what=name, timeout_s=guard.options.timeout_s, peer=peer)
            raise guard.failed(err, True) from e
        return work if work is None else BoundedWork(work, guard, peer, what)

    transfer.__wrapped__ = real  # type: ignore[attr-defined]
    return transfer


RECEIVE = "receive from"
SEND = "send to"


def _guarded(state: _StageState | None, original: Original, args: tuple[Any, ...],
             kwargs: dict[str, Any]) -> Any:
    """``original(*args, **kwargs)`` with this stage's gloo transfers bounded."""
    if state is None:
        return original(*args, **kwargs)
    before = _context.guard
    _context.guard = state.guard
    try:
        return original(*args, **kwargs)
    finally:
        _context.guard = before


def send_dict(original: Original, *args: Any, **kwargs: Any) -> Any:
    scheduler, tensor_dict = args[0], _arg(args, kwargs, 1, "tensor_dict")
    kind = _arg(args, kwargs, 3, "msg_type", "default")
    state = _state(scheduler)
    if state is not None and kind in KINDS and isinstance(tensor_dict, dict):
        g = state.guard
        if kind == "proxy":
            tensor_dict[VIEW_KEY] = g.stamp(kind, scheduler.cur_batch_for_debug)
        elif scheduler.pp_group.is_last_rank:
            tensor_dict[VIEW_KEY] = g.stamp(kind, state.output_send_batch)
        else:  # a relay: the view it was received with, renumbered on this channel
            received = state.relays.pop(id(tensor_dict), None)
            tensor_dict[VIEW_KEY] = g.stamp(kind, None, received)
    return _guarded(state, original, args, kwargs)


def recv_typed_dict(original: Original, *args: Any, **kwargs: Any) -> Any:
    scheduler = args[0]
    kind = _arg(args, kwargs, 1, "expected_kind", "default")
    state = _state(scheduler)
    result = _guarded(state, original, args, kwargs)
    tensor_dict = result[0] if isinstance(result, tuple) else result
    if not isinstance(tensor_dict, dict):
        return result
    carried = tensor_dict.pop(VIEW_KEY, None)
    if state is None or kind not in KINDS:
        return result
    if kind == "proxy":
        state.guard.check(kind, scheduler.cur_batch_for_debug, carried)
    else:
        view = state.guard.check(kind, state.output_recv_batch, carried)
        if not scheduler.pp_group.is_last_rank:
            state.relays[id(tensor_dict)] = view
            while len(state.relays) > _RELAYS_KEPT:
                state.relays.popitem(last=False)
    return result


def send_recv_outputs(original: Original, *args: Any, **kwargs: Any) -> Any:
    scheduler = args[0]
    state = _state(scheduler)
    if state is None:
        return original(*args, **kwargs)
    mbs = _arg(args, kwargs, 3, "mbs")
    state.output_send_batch = mbs[_arg(args, kwargs, 1, "next_first_rank_mb_id")]
    state.output_recv_batch = mbs[_arg(args, kwargs, 2, "next_mb_id")]
    try:
        return original(*args, **kwargs)
    finally:
        state.output_send_batch = state.output_recv_batch = None


def transfers(original: Original, *args: Any, **kwargs: Any) -> Any:
    """A scheduler method whose gloo transfers are all PP messages (the
    request relay's): bounded."""
    return _guarded(_state(args[0]), original, args, kwargs)


_MIXIN = "sglang.srt.managers.scheduler_pp_mixin.SchedulerPPMixin"
HOOKS: dict[str, Original] = {
    f"{_MIXIN}._pp_send_dict_to_next_stage": send_dict,
    f"{_MIXIN}._pp_recv_typed_dict": recv_typed_dict,
    f"{_MIXIN}._pp_send_recv_and_preprocess_output_tensors": send_recv_outputs,
    f"{_MIXIN}._pp_send_pyobj_to_next_stage": transfers,
    f"{_MIXIN}._pp_recv_pyobj_from_prev_stage": transfers,
    "sglang.srt.managers.scheduler.Scheduler.ingest_requests": transfers,
}
"""SGLang function (dotted path) -> its AROUND hook."""
