"""Checks and small helpers of the vLLM handlers (ppsync.compat.vllm): what
each interface's arguments must be, raised before any collective."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TypeVar, cast

import numpy as np
import torch

from ppsync.core.codec.steps import PreparedStep
from ppsync.core.frame.rows import SampledStep
from ppsync.core.rules import batch_view_of, validate_batch
from ppsync.errors import BatchError, ProtocolError

T = TypeVar("T")


class NotGiven:
    """Marks an argument the caller left out (None is a value to check)."""


NOT_GIVEN = NotGiven()


def other_interface(interface: str, other: str, call: str, rule: str) -> ProtocolError:
    """A call in the shape of vLLM ``other``'s interface, made on a handler
    that serves ``interface``'s."""
    return ProtocolError(
        f"{call} is vLLM {other}'s PPHandler interface, but this handler serves "
        f"{interface}'s (interface = {interface!r}), where {rule}")


def check_empty_table(table: object, max_num_reqs: int) -> None:
    """K = 0: vLLM 0.32 still passes its draft table, [max_num_reqs, 0]."""
    name = "draft_tokens_to_update"
    if not isinstance(table, torch.Tensor):
        raise BatchError(f"{name} must be a torch.Tensor, got {type(table).__name__}")
    if tuple(table.shape) != (max_num_reqs, 0):
        raise BatchError(f"{name}.shape = {tuple(table.shape)} must be (max_num_reqs, K) = "
                         f"({max_num_reqs}, 0): num_speculative_steps = 0")


def check_recv_drafts(recv_drafts: object, num_drafts: int) -> bool:
    """Interface 0.33's ``recv_drafts``: a bool, True only when K > 0."""
    if not isinstance(recv_drafts, (bool, np.bool_)):
        raise BatchError(f"recv_drafts = {recv_drafts!r} must be a bool")
    if recv_drafts and num_drafts == 0:
        raise BatchError("recv_drafts = True but num_speculative_steps = 0: no drafts can come")
    return bool(recv_drafts)


def step_width(input_batch: object, sample_width: int) -> int:
    """Interface 0.33: the step's sample width, L = ``sample_width`` when
    the step verifies drafts (``input_batch.num_draft_tokens > 0``), else 1."""
    n = getattr(input_batch, "num_draft_tokens", NOT_GIVEN)
    if n is NOT_GIVEN:
        raise BatchError(
            f"input_batch of type {type(input_batch).__name__} lacks num_draft_tokens, "
            "which interface 0.33 reads for the step's sample width")
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
        raise BatchError(f"input_batch.num_draft_tokens = {n!r} must be an int >= 0")
    return sample_width if n > 0 else 1


def check_held_batch(held: PreparedStep, input_batch: object, max_num_reqs: int) -> None:
    """Interface 0.32's broadcast_drafts names broadcast()'s batch: a valid
    batch (it is a new argument: checked again, as every input is) with the
    same num_reqs and idx_mapping. What is sent is the held step's own copy
    of its facts."""
    view = batch_view_of(input_batch)
    validate_batch(view, max_num_reqs)
    idx_np = held.facts.idx
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


def detached(step: PreparedStep) -> PreparedStep:
    """``step`` with its own copies of every array it sends: on CPU,
    ``prepare`` reads the caller's tensors without copying, and an engine may
    refill those buffers before a held step is sent (device codec: clones on
    the current stream, no host read). The batch's facts are the step's own
    already (``step.facts``), and ``send`` reads the view's num_reqs only."""
    r = step.rows
    if isinstance(r.tokens, np.ndarray):
        assert isinstance(r.num_sampled, np.ndarray) and isinstance(r.num_rejected, np.ndarray)
        rows: SampledStep[np.ndarray] | SampledStep[torch.Tensor] = SampledStep(
            r.tokens.copy(), r.num_sampled.copy(), r.num_rejected.copy(), None, r.sample_width)
    else:
        assert isinstance(r.num_sampled, torch.Tensor) and isinstance(r.num_rejected, torch.Tensor)
        rows = SampledStep(r.tokens.clone(), r.num_sampled.clone(), r.num_rejected.clone(), None,
                           r.sample_width)
    return dataclasses.replace(step, rows=rows)


def rebuilt_like(output: T, merged: Mapping[str, torch.Tensor]) -> T:
    """``merged`` as the type of ``output``: a dict for a dict, another
    mapping type through its constructor, an object carrying ``.tensors``
    (vLLM's IntermediateTensors) with its other fields kept when it is a
    dataclass, else through its constructor."""
    if type(output) is dict:
        return cast(T, dict(merged))
    try:
        if not isinstance(output, Mapping) and dataclasses.is_dataclass(output):
            return cast(T, dataclasses.replace(output, tensors=dict(merged)))  # type: ignore[type-var]
        rebuilt: T = type(output)(dict(merged))  # type: ignore[call-arg]
        return rebuilt
    except (TypeError, ValueError) as e:
        raise BatchError(f"output_intermediate_tensors of type {type(output).__name__} cannot "
                         f"be rebuilt from its tensors ({e})") from None
