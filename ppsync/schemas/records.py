"""The step record: one step as the services report it (``last_record``).

Records carry scalars and shape facts only. Arrays (tokens, counts, drafts,
idx_mapping) are checked for dtype, shape and range by ``ppsync.core.rules.checks``;
they are never copied element by element into Python objects. (The frame's
layout, version and flags are ppsync.core.frame.layout's.)
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator


class StepRecord(BaseModel):
    """One step as a rank sees it, validated where it crosses a service
    boundary (the flight recorder keeps its own events, ppsync.schemas.dump)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    step: int = Field(ge=0)
    """Engine step sequence number."""
    num_reqs: int = Field(ge=0)
    """Rows in the step's batch."""
    num_needed: int = Field(ge=0)
    """Rows that produce a sample this step (the need-sampled mask's count)."""
    sample_width: int = Field(ge=1)
    """L = K + 1."""
    num_drafts: int = Field(ge=0)
    """K."""
    has_drafts: bool = False
    """Whether the step's frame carries drafts."""
    idx_digest: int = 0
    """Digest of the step's row facts, as in the frame header (0 where not
    reported)."""

    @model_validator(mode="after")
    def _needed_within_rows(self) -> StepRecord:
        if self.num_needed > self.num_reqs:
            raise ValueError(
                f"num_needed = {self.num_needed} exceeds num_reqs = {self.num_reqs}"
            )
        if self.sample_width != self.num_drafts + 1:
            raise ValueError(
                f"sample_width = {self.sample_width} must equal num_drafts + 1 = "
                f"{self.num_drafts + 1}"
            )
        return self
