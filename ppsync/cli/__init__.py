"""The ``ppsync`` command (also ``python -m ppsync``).

Parsing imports neither torch nor the rank code: ``ppsync --help`` and a bad
argument answer at once. The command itself (ppsync.cli.commands) is loaded
once the arguments are good.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from ppsync.cli.parser import parse


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` (bad arguments: one line, exit 2) and run the command."""
    args = parse(argv)
    from ppsync.cli.commands import run_command  # torch and the rank code load here

    return run_command(args)


if __name__ == "__main__":
    sys.exit(main())
