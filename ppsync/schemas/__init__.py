"""pydantic models: configuration, frame header, step record, run report.

No torch import here: these are the contract that dumps and reports follow.
"""

from ppsync.schemas.config import SyncConfig, WireMode
from ppsync.schemas.records import (
    FLAG_EXACT,
    FLAG_HAS_DRAFTS,
    FRAME_FORMAT_VERSION,
    FrameHeader,
    StepRecord,
)
from ppsync.schemas.report import RankReport, RunReport

__all__ = [
    "FLAG_EXACT",
    "FLAG_HAS_DRAFTS",
    "FRAME_FORMAT_VERSION",
    "FrameHeader",
    "RankReport",
    "RunReport",
    "StepRecord",
    "SyncConfig",
    "WireMode",
]
