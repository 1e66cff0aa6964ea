"""``python -m ppsync.cli``: the ``ppsync`` command."""

from __future__ import annotations

import sys

from ppsync.cli import main

sys.exit(main())
