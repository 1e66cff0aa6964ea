"""vLLM's scheme's own per-step host calls, so its own CPU is measured
the way ppsync's is (everything but the collectives).

The scheme the token path replaces (vLLM's GPU ``PPHandler`` pattern; see
ppsync.bench): the last rank pads its sampled tokens to K + 1
columns, stacks the two counts, gathers its drafts by ``idx_mapping``, then
broadcasts tokens, counts and drafts; a receiver allocates the three
receive buffers, receives, unbinds the counts and scatters the drafts into
its draft table. :class:`VllmHostOps` makes exactly those calls on a
:class:`FixedStep`; the broadcasts stay with the caller (they are timed
apart and subtracted, as ppsync's issue and waits are).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ppsync.bench.common import FixedStep


@dataclass
class VllmHostOps:
    """One role's host calls of vLLM's scheme for one fixed step."""

    step: FixedStep
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    table: torch.Tensor = field(init=False)  # [rows, K] int64: the draft table

    def __post_init__(self) -> None:
        rows, K = self.step.tokens.shape[0], self.step.tokens.shape[1] - 1
        self.table = torch.zeros((rows, K), dtype=torch.int64, device=self.device)
        self._idx = torch.from_numpy(self.step.view.idx_mapping_np).to(self.device)

    @property
    def has_drafts(self) -> bool:
        return self.step.drafts is not None

    def last_before(self) -> tuple[torch.Tensor, ...]:
        """Last rank, before its broadcasts: (tokens padded to K + 1,
        counts [2, rows], drafts gathered by idx when K > 0)."""
        s = self.step
        rows, width = s.tokens.shape
        padded = torch.zeros((rows, width), dtype=torch.int64, device=self.device)  # K + 1
        padded[:, :width] = s.tokens
        out: tuple[torch.Tensor, ...] = (padded, torch.stack((s.num_sampled, s.num_rejected)))
        if self.has_drafts:
            out += (self.table[self._idx],)
        return out

    def receiver_before(self) -> tuple[torch.Tensor, ...]:
        """A receiver, before its broadcasts: the empty receive buffers."""
        rows, width = self.step.tokens.shape
        dev = self.device
        out: tuple[torch.Tensor, ...] = (
            torch.empty((rows, width), dtype=torch.int64, device=dev),
            torch.empty((2, rows), dtype=torch.int32, device=dev),
        )
        if self.has_drafts:
            out += (torch.empty((rows, width - 1), dtype=torch.int64, device=dev),)
        return out

    def receiver_after(self, bufs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """A receiver, after its broadcasts: the counts unbound, the drafts
        scattered into the draft table; (tokens, num_sampled, num_rejected)."""
        num_sampled, num_rejected = bufs[1].unbind(0)
        if self.has_drafts:
            self.table[self._idx] = bufs[2]
        return bufs[0], num_sampled, num_rejected
