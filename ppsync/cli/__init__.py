"""The ``ppsync`` command (also ``python -m ppsync``).

Parsing imports neither torch nor the rank code: ``ppsync --help`` and a bad
argument answer at once. The command itself (ppsync.cli.commands) is loaded
once the arguments are good.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

from ppsync.cli.parser import parse


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` (bad arguments: one line, exit 2) and run the command.
    A reader that closes the pipe early (``ppsync dump show --json | head``)
    ends the command quietly, exit 1, as Python's documentation advises."""
    try:
        args = parse(argv)
        from ppsync.cli.commands import run_command  # torch and the rank code load here

        code = run_command(args)
        sys.stdout.flush()  # a closed pipe shows here, not at the interpreter's exit
        return code
    except BrokenPipeError:
        # no more output can go there: point stdout at /dev/null so that the
        # interpreter's own flush at exit does not fail again
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    sys.exit(main())
