"""What ``ppsync vllm-check`` runs (its options, one object): read by the
one-host check (check.py) and the two-host one (nodes_check.py)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

__all__ = ["VllmCheckOptions"]


@dataclass(frozen=True)
class VllmCheckOptions:
    """What ``ppsync vllm-check`` runs; see its ``--help``."""

    pp_size: int = 2
    prompts: int = 4
    max_tokens: int = 12
    calls: int = 2  # generate calls per run
    seed: int = 0
    hidden: int = 128
    layers_per_stage: int = 2
    timeout_s: float = 900.0
    work_dir: Path | None = None
    spec: int = 0  # K draft tokens per step (0: no speculative decoding)
    spec_method: str = "ngram_gpu"
    settings: tuple[tuple[str, str], ...] = ()  # PPSYNC_* variables for ppsync's runs
    handler_timeout_s: float | None = None  # PPSYNC_TIMEOUT_S (None: the handler's default)
    handler_silent_s: float | None = None  # PPSYNC_SILENT_S (None: the handler's default)
    fault: str | None = None  # faults.FAULTS, healthy.HEALTHY, or a node fault
    fault_after: int = 4  # the faulted worker's step
    fault_bound_s: float = 120.0  # watched this long after the fault
    slow_s: float = 90.0  # --fault slow-last: the last worker's stall in one step
    idle_s: float = 180.0  # --fault idle: the engine idles this long between calls
    repeat: int = 1  # runs per handler, alternating (timing.py)
    nodes: int = 1  # hosts (network namespaces); 2: served over HTTP (nodes_check.py)
    mismatch: str | None = None  # --nodes 2: one node with other settings (mismatch.py)
    requests: int = 12  # --nodes 2: the HTTP burst's requests
