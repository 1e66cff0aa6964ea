"""anyio services: BroadcastService (last rank), ReceiveService (other ranks)
and the per-rank runtime ``open_rank``."""

from ppsync.services.endpoints import BroadcastService, ReceiveService
from ppsync.services.runtime import Rank, open_rank

__all__ = ["BroadcastService", "Rank", "ReceiveService", "open_rank"]
