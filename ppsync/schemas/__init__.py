"""pydantic models: configuration, step record, run report, dumps, bench reports.

No torch import here: these are the contract that dumps and reports follow.
"""

from ppsync.schemas.config import SyncConfig, WireMode
from ppsync.schemas.records import StepRecord
from ppsync.schemas.run_report import RankReport, RunReport

__all__ = [
    "RankReport",
    "RunReport",
    "StepRecord",
    "SyncConfig",
    "WireMode",
]
