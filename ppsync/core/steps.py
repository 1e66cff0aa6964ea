"""The records one token path keeps between the calls of a step: the
caller's names for its calls (and the errors that speak them), a receive
posted and waiting in the ring, and a last-rank step that passed its
checks."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from ppsync.core.batch import BatchView
from ppsync.core.batch.facts import BatchFacts
from ppsync.core.frame import FrameView
from ppsync.errors import RoleError


@dataclass(frozen=True, slots=True)
class CallNames:
    """How the caller's API names the token path's calls, so that errors speak
    the API in use: the services' ``take()``, the vLLM adapter's
    ``get_prev_sampled_outputs()``, or the token path's own ``consume()``."""

    consume: str = "consume"
    post: str = "post"
    publish: str = "publish"


TOKEN_PATH_NAMES = CallNames()
"""The token path's own names: consume(), post(), publish()."""


def role_error(op: str, *, rank: int, pp_size: int, last: bool) -> RoleError:
    """``op()`` belongs to the last rank (``last``) or to the others, and
    group ``rank`` of ``pp_size`` is not such a rank."""
    who = "the last rank" if last else "a non-last rank"
    return RoleError(f"{op}() belongs to {who}; group rank {rank} of pp_size {pp_size} is "
                     f"{'not the last' if last else 'the last'} rank")


@dataclass(slots=True)
class PendingStep:
    """A posted receive, waiting in the ring for its consume."""

    frame: FrameView
    need_np: np.ndarray  # [num_reqs] bool
    needed: int  # need_np.sum()
    idx_np: np.ndarray  # [num_reqs] int64, a copy of the batch's idx_mapping
    freed_mark: int  # GenerationTable.mark() when posted (rule 3)
    buf: torch.Tensor  # [words] int64 frame buffer the receive fills
    work: dist.Work
    expect_drafts: bool | None = None  # None: take the frame's word for it
    staging: torch.Tensor | None = None  # device codec: host facts of this rank's view


@dataclass(slots=True)  # read-only by convention: frozen costs the hot path (docs/measured.md)
class PreparedStep:
    """A last-rank step whose inputs passed every check; ready to send."""

    view: BatchView
    facts: BatchFacts  # the view's checked facts and need mask (own copies)
    tokens_np: np.ndarray | None  # [num_reqs, w] int; None with the device codec
    num_sampled_np: np.ndarray | None  # [num_reqs] int; None with the device codec
    num_rejected_np: np.ndarray | None  # [num_reqs] int; None with the device codec
    sample_width: int | None = None  # the step's width w in the header; None = L
    outputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    """The device codec's unread (tokens, num_sampled, num_rejected)."""
