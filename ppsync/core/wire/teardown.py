"""What becomes of a token group whose transfers were abandoned.

A token path closed without draining (after a failure, or when the engine is
cancelled) leaves gloo work in flight that only ends when the peer sends, the
connection breaks, or the group's timeout passes. If nothing is done, the
garbage collector destroys the process group at interpreter exit and gloo's
destructor waits for that work: a survivor of a silent peer then hangs at exit
for the rest of the group's timeout (seen: 25 s after a 5 s SyncTimeout).

So a group with abandoned work is never destroyed: it stays referenced until
the process exits, which reclaims it without waiting. (The async services
also make sure no such work still carries a Python callback when the
interpreter finalizes; see ``ppsync.services.awaiting``.)
"""

from __future__ import annotations

import ctypes
import datetime

import torch.distributed as dist

_kept: set[int] = set()  # id() of groups kept alive


def keep_until_exit(group: dist.ProcessGroup) -> None:
    """Never destroy ``group``: process exit reclaims it. A module-level list
    would not do, since module globals are cleared at finalization before the
    last garbage collection; one extra reference that nothing drops does."""
    if id(group) in _kept:
        return
    _kept.add(id(group))
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(group))


def bound_group_timeout(group: dist.ProcessGroup, timeout_s: float) -> None:
    """Make every collective issued on ``group`` from now on end (complete or
    fail) within ``timeout_s``, so no abandoned work outlives the token path's
    own deadline by more than that."""
    group.set_timeout(datetime.timedelta(seconds=timeout_s))
