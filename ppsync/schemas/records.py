"""Per-step records: the frame header as data, and the step record that the
services validate at their boundary and the flight recorder keeps.

Records carry scalars and shape facts only. Arrays (tokens, counts, drafts,
idx_mapping) are checked for dtype, shape and range by ``ppsync.core.checks``;
they are never copied element by element into Python objects.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator

FRAME_FORMAT_VERSION = 3

FLAG_HAS_DRAFTS = 1
"""The frame's draft columns hold this step's drafts."""
FLAG_EXACT = 2
"""The frame is sized for num_reqs rows, not max_num_reqs."""
FLAG_BAD_VALUES = 4
"""The device codec found a num_sampled or num_rejected value out of range
while packing (its checks run on the device, after the step was issued);
every receiver raises on such a frame."""


class FrameHeader(BaseModel):
    """The header words at the front of every frame (all int64 on the wire)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    version: int = Field(ge=0)
    """Frame format version; receivers reject a version they do not know."""
    step: int = Field(ge=0)
    """Engine step sequence number; every rank counts steps the same way."""
    num_reqs: int = Field(ge=0)
    """Rows in the step's batch."""
    sample_width: int = Field(ge=1)
    """The step's sample width: L = K + 1, or fewer for an engine that varies
    it per step (vLLM 0.33: 1 when the step verifies no drafts)."""
    num_drafts: int = Field(ge=0)
    """K draft columns per row."""
    flags: int = Field(ge=0)
    """Bit set of FLAG_HAS_DRAFTS, FLAG_EXACT and FLAG_BAD_VALUES."""
    idx_digest: int
    """Digest of the step's idx_mapping (see ppsync.core.frame.idx_digest)."""
    checksum: int
    """Checksum of the used payload rows."""


class StepRecord(BaseModel):
    """One step as a rank sees it, validated where it crosses a service
    boundary and kept by the flight recorder."""

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
    """Digest of idx_mapping, as in the frame header."""

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
