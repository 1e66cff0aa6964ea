"""What a fault run of ``ppsync vllm-check`` installs in one vLLM worker:
the worker hooks (ppsync.checks.vllm.worker_hooks) import this
module once vLLM has built the worker's model runner, and wrap the handler's
calls and the runner's ``execute_model`` with what it returns:

- ``PPSYNC_VLLM_CHECK_FAULT=ACTION:RANK:N``: :func:`fault_for`, the worker
  of PP rank RANK sends itself ACTION's signal at its N-th step;
- ``PPSYNC_VLLM_CHECK_SLOW=RANK:N:SECONDS``: :func:`slow_for`, the worker
  of PP rank RANK sleeps SECONDS before its N-th model step.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable
from typing import Any

from ppsync.checks.vllm.worker_hooks import ENV_FAULT, ENV_SLOW, FAULT_SIGNALS

__all__ = ["fault_for", "slow_for"]


def fault_for(pp_rank: int, call: str, out: Any) -> Callable[[str], None] | None:
    """The fault ``PPSYNC_VLLM_CHECK_FAULT`` asks of this worker: called
    before each timed call; at the N-th ``call`` it records the time and
    signals this process."""
    raw = os.environ.get(ENV_FAULT, "")
    if not raw:
        return None
    action, rank, after = raw.split(":")
    if int(rank) != pp_rank:
        return None
    count = [0]

    def maybe_fault(name: str) -> None:
        if name != call:
            return
        count[0] += 1
        if count[0] == int(after):
            out.write(json.dumps({"event": "fault", "t": time.time(), "action": action,
                                  "pp_rank": pp_rank, "step": count[0]}) + "\n")
            out.flush()
            os.kill(os.getpid(), getattr(signal, FAULT_SIGNALS[action]))

    return maybe_fault


def slow_for(pp_rank: int, execute_model: Callable[..., Any],
              out: Any) -> Callable[..., Any] | None:
    """``execute_model`` slowed as ``PPSYNC_VLLM_CHECK_SLOW`` asks of this
    worker (None: not this one): its N-th call that runs the model sleeps
    first, once, and records ``{"event": "slow", "t", "s", "step"}``."""
    raw = os.environ.get(ENV_SLOW, "")
    if not raw:
        return None
    rank, after, seconds = raw.split(":")
    if int(rank) != pp_rank:
        return None
    count = [0]

    def slowed(scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        runs = not kwargs.get("dummy_run", False) and getattr(
            scheduler_output, "total_num_scheduled_tokens", 0) > 0
        if runs:
            count[0] += 1
            if count[0] == int(after):
                t0 = time.time()
                time.sleep(float(seconds))
                out.write(json.dumps({"event": "slow", "t": t0, "s": time.time() - t0,
                                      "step": count[0]}) + "\n")
                out.flush()
        return execute_model(scheduler_output, *args, **kwargs)

    return slowed
