"""What a consumer hands the engine for one released step (declared with
the row's columns: ppsync.core.frame.rows)."""

from __future__ import annotations

from ppsync.core.frame.rows import ReleasedStep

__all__ = ["ReleasedStep"]
