"""Checks on a step's sampled outputs, before anything is packed or sent.

Each check raises :class:`BatchError` naming the field, the value and the
rule. Arrays are checked with a few numpy reductions; nothing is turned into
Python lists.
"""

from __future__ import annotations

import numpy as np
import torch

from ppsync.core.rules import out_of_range
from ppsync.errors import BatchError

_INT_DTYPES = (torch.int64, torch.int32)


def _tensor(name: str, t: object, ndim: int, dtypes: tuple[torch.dtype, ...]) -> torch.Tensor:
    """``t`` if it is a tensor of one of ``dtypes`` with ``ndim`` dims."""
    if not isinstance(t, torch.Tensor):
        raise BatchError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        allowed = " or ".join(str(d) for d in dtypes)
        raise BatchError(f"{name}.dtype = {t.dtype} must be {allowed}")
    if t.dim() != ndim:
        raise BatchError(f"{name} has {t.dim()} dims, shape {tuple(t.shape)}; {ndim} expected")
    return t


def _host(
    name: str, t: object, ndim: int, dtypes: tuple[torch.dtype, ...] = _INT_DTYPES
) -> np.ndarray:
    if type(t) is torch.Tensor and t.dtype in dtypes and t.is_cpu and not t.requires_grad:
        a: np.ndarray = t.numpy()  # the usual tensor: shares memory
        if a.ndim == ndim:
            return a
    t = _tensor(name, t, ndim, dtypes)
    if t.is_cpu and not t.requires_grad:
        return t.numpy()  # shares memory; half the cost of detach().cpu().numpy()
    # an accelerator's tensor is copied (a host sync the engine chose with the
    # host codec); one whose data the host cannot read (meta) is refused as the
    # device codec refuses a tensor off its device, before any collective
    if t.is_meta:
        raise _elsewhere(name, t.device, _CPU)
    try:
        return t.detach().cpu().numpy()
    except NotImplementedError:  # a backend without a copy to the host
        raise _elsewhere(name, t.device, _CPU) from None


_CPU = torch.device("cpu")


def _elsewhere(name: str, device: torch.device, home: torch.device) -> BatchError:
    return BatchError(f"{name} is on {device}; the token path's device is {home}")


def _meta(name: str, t: object, ndim: int, device: torch.device,
          dtypes: tuple[torch.dtype, ...] = _INT_DTYPES) -> torch.Tensor:
    """Type, dtype, dims and device of ``t``; its values are not read."""
    t = _tensor(name, t, ndim, dtypes)
    if t.device != device:
        raise _elsewhere(name, t.device, device)
    return t.detach() if t.requires_grad else t  # a detach is a dispatch per tensor


def _check_shapes(tokens: tuple[int, ...], num_sampled: tuple[int, ...],
                  num_rejected: tuple[int, ...], *, num_reqs: int, sample_width: int) -> None:
    """The shapes of one step's sampler outputs (both codecs)."""
    rows, w = tokens
    if rows != num_reqs:
        raise BatchError(f"sampled_token_ids.shape[0] = {rows} must equal num_reqs = {num_reqs}")
    if not 1 <= w <= sample_width:
        raise BatchError(f"sampled_token_ids.shape[1] = {w} must lie in [1, L = {sample_width}] "
                         "(L = num_speculative_steps + 1)")
    for name, shape in (("num_sampled", num_sampled), ("num_rejected", num_rejected)):
        if shape[0] != num_reqs:
            raise BatchError(f"{name}.shape = {shape} must be (num_reqs,) = ({num_reqs},)")


def check_sample_width(sample_width: int | None, L: int) -> None:
    """A step's own sample width: None (= L) or an int in [1, L]."""
    if sample_width is None:
        return
    if isinstance(sample_width, bool) or not isinstance(sample_width, int):
        raise BatchError(f"sample_width = {sample_width!r} must be an int or None")
    if not 1 <= sample_width <= L:
        raise BatchError(f"sample_width = {sample_width} must lie in [1, L = {L}] "
                         "(L = num_speculative_steps + 1)")


def check_width_fits(w: int, sample_width: int | None) -> None:
    """Tokens ``w`` wide fit the step's own sample width (None: L, checked
    with the shapes)."""
    if sample_width is not None and w > sample_width:
        raise BatchError(f"sampled_token_ids.shape[1] = {w} exceeds the "
                         f"step's sample width {sample_width}")


def value_bounds(w: int, num_drafts: int, step_width: int | None = None) -> tuple[int, int]:
    """The largest valid (num_sampled, num_rejected) of a step whose tokens
    are ``w`` wide and whose own sample width is ``step_width`` (None: L): a
    step verifies at most ``step_width - 1`` drafts, so it rejects at most
    that many (vLLM 0.33: none in a width-1 step). The one rule both codecs
    check, the host in numpy before the send, the device in torch ops while
    packing and receiving."""
    max_nr = num_drafts if step_width is None else min(num_drafts, step_width - 1)
    return w, max_nr


def value_error(num_sampled_np: np.ndarray, num_rejected_np: np.ndarray, *, w: int,
                num_drafts: int, step_width: int | None = None,
                prefix: str = "") -> BatchError | None:
    """The BatchError naming the first num_sampled / num_rejected outside
    :func:`value_bounds` (field, row, value, rule), or None when all lie in
    range. ``prefix`` starts the message (a receiver names the frame)."""
    max_ns, max_nr = value_bounds(w, num_drafts, step_width)
    if out_of_range(num_sampled_np, max_ns + 1):  # one pass, no copy; catches negatives too
        bad = (num_sampled_np < 0) | (num_sampled_np > max_ns)
        return _first_bad(f"{prefix}num_sampled", num_sampled_np, bad,
                          f"outside [0, w = {w}] (the sample width sent)")
    if out_of_range(num_rejected_np, max_nr + 1):
        bad = (num_rejected_np < 0) | (num_rejected_np > max_nr)
        rule = (f"outside [0, K = {num_drafts}] (num_speculative_steps)" if max_nr == num_drafts
                else f"outside [0, {max_nr}] (a step of sample width {step_width} verifies "
                f"at most {max_nr} drafts)")
        return _first_bad(f"{prefix}num_rejected", num_rejected_np, bad, rule)
    return None


def _some_drafts(name: str, num_drafts: int) -> None:
    if num_drafts == 0:
        raise BatchError(f"{name} given but num_speculative_steps = 0: there are no drafts")


def _drafts_shape(name: str, shape: tuple[int, ...], rows_name: str, rows: int,
                  num_drafts: int) -> None:
    """Drafts (or a draft table) are [rows, K]."""
    if shape != (rows, num_drafts):
        raise BatchError(f"{name}.shape = {shape} must be ({rows_name}, K) = "
                         f"({rows}, {num_drafts})")


def check_sampled_meta(
    sampled_token_ids: object,  # [num_reqs, w] int64, 1 <= w <= L
    num_sampled: object,  # [num_reqs] int32
    num_rejected: object,  # [num_reqs] int32
    *,
    num_reqs: int,
    sample_width: int,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The device codec's immediate checks of one step's sampler outputs:
    types, dtypes, shapes, device. The values are checked on the device
    (ppsync.core.frame.device_frames), without a host sync."""
    tokens = _meta("sampled_token_ids", sampled_token_ids, 2, device, (torch.int64,))
    ns = _meta("num_sampled", num_sampled, 1, device)
    nr = _meta("num_rejected", num_rejected, 1, device)
    _check_shapes(tuple(tokens.shape), tuple(ns.shape), tuple(nr.shape), num_reqs=num_reqs,
                  sample_width=sample_width)
    return tokens, ns, nr


def check_step_drafts_meta(
    draft_tokens: object, *, num_reqs: int, num_drafts: int, device: torch.device
) -> torch.Tensor:
    """The device codec's checks of one step's drafts [num_reqs, K]."""
    _some_drafts("draft_tokens", num_drafts)
    drafts = _meta("draft_tokens", draft_tokens, 2, device)
    _drafts_shape("draft_tokens", tuple(drafts.shape), "num_reqs", num_reqs, num_drafts)
    return drafts


def check_draft_table_meta(
    draft_tokens: object, *, max_num_reqs: int, num_drafts: int, device: torch.device,
    name: str = "draft_tokens",
) -> torch.Tensor:
    """The device codec's checks of a [max_num_reqs, K] draft table (values
    not read)."""
    _some_drafts(name, num_drafts)
    table = _meta(name, draft_tokens, 2, device)
    _drafts_shape(name, tuple(table.shape), "max_num_reqs", max_num_reqs, num_drafts)
    return table


def _first_bad(name: str, a: np.ndarray, bad: np.ndarray, rule: str) -> BatchError:
    i = np.unravel_index(int(np.argmax(bad)), bad.shape)
    where = ", ".join(str(int(x)) for x in i)
    return BatchError(f"{name}[{where}] = {int(a[i])} {rule}")


def sampled_arrays(
    sampled_token_ids: object,  # [num_reqs, w] int64, 1 <= w <= L
    num_sampled: object,  # [num_reqs] int32
    num_rejected: object,  # [num_reqs] int32
    *,
    num_reqs: int,
    sample_width: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The host arrays of one step's sampler outputs, their types, dtypes
    and shapes checked (values not read)."""
    # token ids are int64 end to end (vLLM asserts it): a narrower dtype is a
    # caller's bug, and accepting it let a retried call send a step twice
    tokens_np = _host("sampled_token_ids", sampled_token_ids, 2, (torch.int64,))
    ns_np = _host("num_sampled", num_sampled, 1)
    nr_np = _host("num_rejected", num_rejected, 1)
    _check_shapes(tokens_np.shape, ns_np.shape, nr_np.shape, num_reqs=num_reqs,
                  sample_width=sample_width)
    return tokens_np, ns_np, nr_np


def check_sampled(
    sampled_token_ids: object,  # [num_reqs, w] int64, 1 <= w <= L
    num_sampled: object,  # [num_reqs] int32
    num_rejected: object,  # [num_reqs] int32
    *,
    num_reqs: int,
    sample_width: int,
    num_drafts: int,
    step_width: int | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Validate one step's sampler outputs (``step_width``: the step's own
    sample width, None = L); return their host arrays."""
    tokens_np, ns_np, nr_np = sampled_arrays(sampled_token_ids, num_sampled, num_rejected,
                                             num_reqs=num_reqs, sample_width=sample_width)
    err = value_error(ns_np, nr_np, w=tokens_np.shape[1], num_drafts=num_drafts,
                      step_width=step_width)
    if err is not None:
        raise err
    return tokens_np, ns_np, nr_np


def check_draft_table(
    draft_tokens: object, *, max_num_reqs: int, num_drafts: int, name: str = "draft_tokens"
) -> np.ndarray:
    """Validate a [max_num_reqs, K] draft table; return its host array."""
    _some_drafts(name, num_drafts)
    table_np = _host(name, draft_tokens, 2)
    _drafts_shape(name, table_np.shape, "max_num_reqs", max_num_reqs, num_drafts)
    return table_np


def check_draft_target(
    draft_tokens_to_update: object, *, max_num_reqs: int, num_drafts: int
) -> torch.Tensor:
    """Validate the table a consumer scatters drafts into; return it."""
    name = "draft_tokens_to_update"
    if not isinstance(draft_tokens_to_update, torch.Tensor):
        got = type(draft_tokens_to_update).__name__
        raise BatchError(f"{name} must be a torch.Tensor, got {got}")
    _some_drafts(name, num_drafts)
    _drafts_shape(name, tuple(draft_tokens_to_update.shape), "max_num_reqs", max_num_reqs,
                  num_drafts)
    if draft_tokens_to_update.dtype not in _INT_DTYPES:
        raise BatchError(f"{name}.dtype = {draft_tokens_to_update.dtype} must be int64 or int32")
    if draft_tokens_to_update.is_meta:  # checked for every codec: drafts would vanish there
        raise BatchError(f"{name} is on meta: a tensor without data cannot take drafts")
    return draft_tokens_to_update


def check_step_drafts(draft_tokens: object, *, num_reqs: int, num_drafts: int) -> np.ndarray:
    """Validate one step's drafts, [num_reqs, K] (already gathered by
    idx_mapping); return the host array."""
    _some_drafts("draft_tokens", num_drafts)
    drafts_np = _host("draft_tokens", draft_tokens, 2)
    _drafts_shape("draft_tokens", drafts_np.shape, "num_reqs", num_reqs, num_drafts)
    return drafts_np


def check_drafts_array(drafts_np: object, *, num_reqs: int, num_drafts: int) -> None:
    """Validate a prepared step's drafts given as a host array, [num_reqs, K]
    of an integer dtype (the host codec's ``send``)."""
    if not isinstance(drafts_np, np.ndarray) or drafts_np.dtype.kind not in "iu":
        got = getattr(drafts_np, "dtype", type(drafts_np).__name__)
        raise BatchError(f"drafts must be an integer numpy array, got {got}")
    if drafts_np.shape != (num_reqs, num_drafts):
        raise BatchError(f"drafts shape {drafts_np.shape} must be (num_reqs, K) = "
                         f"({num_reqs}, {num_drafts})")
