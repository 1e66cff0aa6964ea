"""The configuration handshake: every rank of the token group checks, once,
that all ranks agree on what shapes the frames have.

Frames are sized from (max_num_reqs, K, wire); two ranks that disagree would
post buffers of different sizes, and gloo answers that by silently part-filling
a larger buffer or aborting the process that posted a smaller one. One small
all_gather at start-up turns that into a DesyncError on every rank.
"""

from __future__ import annotations

import secrets

import torch
import torch.distributed as dist

from ppsync.core.codec import StepCodec
from ppsync.core.frame.layout import FRAME_FORMAT_VERSION
from ppsync.core.wire.board import FailureBoard
from ppsync.core.wire.completion import Completion
from ppsync.errors import DesyncError, SyncTimeout
from ppsync.schemas.config import SyncConfig

_FIELDS = ("version", "pp_size", "max_num_reqs", "num_speculative_steps", "ring_depth",
           "exact_wire", "device_codec", "device_kernels", "carrier")
KERNEL_SET_CODES = {"none": 0, "torch": 1, "triton": 2}
"""The ``device_kernels`` word: the device codec's kernel set by its code
(none: host codec). A code, once given, is never reused nor renumbered: a
rank of another ppsync release must read it as the same set; a new kernel
set takes the next free code."""
_KERNEL_SET_NAMES = {code: name for name, code in KERNEL_SET_CODES.items()}
CARRIER_CODES = {"host": 1, "device": 2}
"""The ``carrier`` word: the device codec's carrier (0: the host codec,
whose frames are host frames either way); codes are never reused."""
_CARRIER_NAMES = {code: name for name, code in CARRIER_CODES.items()}


def config_words(config: SyncConfig, *, on_device: bool, device_kernels: str) -> list[int]:
    """What every rank must agree on, as integers (see ``_FIELDS``), with
    where this rank's codec keeps frames (``on_device``, its answer: not
    asked of the config again) and which device kernel set it chose."""
    return [FRAME_FORMAT_VERSION, config.pp_size, config.max_num_reqs,
            config.num_speculative_steps, config.depth, int(config.wire == "exact"),
            int(on_device), KERNEL_SET_CODES[device_kernels],
            CARRIER_CODES[config.carrier] if on_device else 0]


class Handshake:
    """The configuration all-gather, issued; :meth:`finish` checks it.

    Collective: every rank of the group starts it once, before any frame.
    An event loop awaits :attr:`work` by notification before calling
    :meth:`finish`, so the wait for slow peers never blocks the loop."""

    def __init__(self, config: SyncConfig, group: dist.ProcessGroup, *, rank: int,
                 completion: Completion, codec: StepCodec,
                 device: torch.device | None = None) -> None:
        """``completion``: the group's semantics (the current stream is
        ordered after the gathered words before they are read);
        ``device``: where the words go (an NCCL / XCCL group takes device
        tensors only; start-up, so reading them back is no hot-path sync);
        ``codec``: the codec this rank built (where its frames live, its
        device kernel set: "none" for the host codec).
        The rank marks its arrival on the failure board before it builds its
        codec (ppsync.core.path.group_end), so that :func:`never_arrived`
        names only the ranks that never started."""
        self.config = config
        self.completion = completion
        self.rank = rank
        self.words = config_words(config, on_device=codec.on_device,
                                  device_kernels=codec.device_kernels_name)
        nonce = secrets.randbits(62)
        mine = torch.tensor([*self.words, nonce], dtype=torch.int64, device=device)
        self._gathered = [torch.empty_like(mine) for _ in range(config.pp_size)]
        # the group's own call: it also serves a group not registered with
        # torch.distributed (see ppsync.core.wire.groups.group_facts)
        self.work: dist.Work = completion.adopt(group.allgather([self._gathered], [mine]))

    def finish(self) -> int:
        """Once :attr:`work` ended (the caller waited for it), raise
        DesyncError, on every rank alike, if any rank's words differ.
        Returns the run id the ranks agree on: group rank 0's random nonce,
        gathered with the words (it scopes the failure board to this run)."""
        rank = self.rank
        self.completion.wait(self.work, timeout_s=0.0,  # ended: its own error, if any
                             what=f"rank {rank}: configuration handshake", peer=None)
        self.completion.order_after(self.work)  # start-up: the current stream, before .cpu()
        self._gathered = [g.cpu() for g in self._gathered]
        ref = dict(zip(_FIELDS, self.words, strict=True))
        for other, words in enumerate(self._gathered):
            theirs = dict(zip(_FIELDS, (int(w) for w in words[:-1]), strict=True))
            if theirs != ref:
                diffs = ", ".join(f"{k}: mine {_word(k, v)} vs rank {other} "
                                  f"{_word(k, theirs[k])}"
                                  for k, v in ref.items() if theirs[k] != v)
                raise DesyncError(
                    f"rank {rank}: group rank {other} has another configuration ({diffs})",
                    expected=ref, received=theirs,
                )
        return int(self._gathered[0][-1])


def never_arrived(err: SyncTimeout, board: FailureBoard | None) -> SyncTimeout:
    """A handshake that did not complete within timeout_s (``err``): the
    error naming the ranks that never reached it, from their arrival marks
    on the board (``err`` itself where nobody can be named)."""
    absent = [] if board is None else board.absent("handshake")
    if not absent:
        return err
    ranks = ", ".join(map(str, absent))
    return SyncTimeout(f"{err}: rank(s) {ranks} (global) never reached the configuration "
                       "handshake", peer=absent[0])


def _word(field: str, value: int) -> str:
    """A handshake word as a message shows it (the kernel set by name)."""
    if field == "device_kernels" and value in _KERNEL_SET_NAMES:
        return _KERNEL_SET_NAMES[value]
    if field == "carrier" and value in _CARRIER_NAMES:
        return _CARRIER_NAMES[value]
    return str(value)
