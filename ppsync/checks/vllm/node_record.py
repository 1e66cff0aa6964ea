"""What the worker hooks (ppsync.checks.vllm.worker_hooks) record for
``vllm-check --nodes``, imported in a vLLM worker only once vLLM runs there
(the hooks themselves import nothing from ppsync at interpreter start)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

__all__ = ["node_facts", "record_init_error"]

ENV_NODE = "PPSYNC_VLLM_CHECK_NODE"


def node_facts() -> dict[str, str]:
    """This worker's host as the check named it (``PPSYNC_VLLM_CHECK_NODE``)
    and the interface its gloo groups bind (``GLOO_SOCKET_IFNAME``)."""
    pairs = (("node", ENV_NODE), ("gloo_ifname", "GLOO_SOCKET_IFNAME"))
    return {k: os.environ[v] for k, v in pairs if os.environ.get(v)}


def record_init_error(record_dir: Path, t0: float, e: BaseException) -> None:
    """A model runner that raised while being built (ppsync's refusal of
    another node's settings): its PP rank, host, when it began and ended,
    the error's first line, in ``init-error-<pid>.jsonl``."""
    from vllm.distributed.parallel_state import get_pp_group

    text = str(e).splitlines()
    with (record_dir / f"init-error-{os.getpid()}.jsonl").open("a") as f:
        f.write(json.dumps({"event": "init_error", "pid": os.getpid(), "t0": t0, "t": time.time(),
                            "pp_rank": get_pp_group().rank_in_group, "type": type(e).__name__,
                            "line": text[0] if text else "", **node_facts()}) + "\n")
