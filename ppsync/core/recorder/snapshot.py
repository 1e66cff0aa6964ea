"""A flight-recorder dump's content and its file: one JSON Lines file per
token path (``ppsync.schemas.dump``): header, events oldest first, footer.
It is written to a temporary file in the target directory and renamed, so a
reader never sees half a dump."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import tempfile
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from pydantic import BaseModel

from ppsync.core.recorder.flight import FIELDS, clock_pair
from ppsync.core.recorder.registry import Dumpable, entry, world
from ppsync.schemas.dump import (
    DUMP_FORMAT_VERSION,
    EVENT_KINDS,
    DumpFooter,
    DumpHeader,
    DumpReason,
)

_writing = False  # a dump is being written (a signal then does not start another)


def writing() -> bool:
    """Whether a dump is being written in this process now."""
    return _writing


def _version() -> str:
    try:
        return metadata.version("ppsync")
    except metadata.PackageNotFoundError:
        return "unknown"


def write_dump(path: Dumpable, file: Path, *, reason: DumpReason,
               error: BaseException | None = None) -> Path:
    """Write ``path``'s dump to ``file`` (atomically); return ``file``."""
    global _writing
    _writing = True
    try:
        snapshot(path, reason, error).write(file)
        return file
    finally:
        _writing = False


class Snapshot:
    """A dump's content taken on the recording thread (a copy of the ring:
    one memcpy), turned into lines by whichever thread writes it."""

    def __init__(self, header: DumpHeader, rows: np.ndarray, first: int, errors: list[str],
                 footer: DumpFooter) -> None:
        self.header, self.rows, self.first = header, rows, first
        self.errors, self.footer = errors, footer

    def _event_lines(self) -> Iterator[str]:
        rows, clock = self.rows, self.header.clock
        if rows.shape[0] == 0:
            return
        kinds = rows[:, 0]
        # wall = clock.wall + (mono - clock.mono); the kind's and error's names
        wall = rows[:, _MONO] + (clock.wall_ns - clock.mono_ns)
        names = [json.dumps(n) for n in self.errors]
        body = np.concatenate((rows[:, 1:-1], wall[:, None]), axis=1).tolist()
        for k, (kind, err, values) in enumerate(zip(kinds.tolist(), rows[:, -1].tolist(), body,
                                                    strict=True)):
            name = EVENT_KINDS[kind] if 0 <= kind < len(EVENT_KINDS) else "error"
            error = names[err - 1] if 0 < err <= len(names) else "null"
            yield _EVENT_LINE % (self.first + k, name, *values, error)

    def write(self, file: Path) -> None:
        """Write to a fresh temporary file in ``file``'s directory (created
        exclusively: never through a link planted there), then rename."""
        file.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{file.name}.", suffix=".tmp", dir=file.parent)
        try:
            os.fchmod(fd, 0o644)  # mkstemp's 0600 would hide the dump from the reading tools
            with os.fdopen(fd, "w") as f:
                f.write(json_line(self.header))
                f.writelines(self._event_lines())
                f.write(json_line(self.footer))
            os.replace(tmp, file)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise


_LINE_BREAKS = str.maketrans({"\u0085": "\\u0085", "\u2028": "\\u2028",
                              "\u2029": "\\u2029"})
"""Characters that JSON leaves raw in a string but some readers' line
splits (Python's str.splitlines, JavaScript's line terminators) break a
line at: written as escapes, so every line survives any reader's split
(the other line breaks are control characters, which JSON escapes)."""


def json_line(model: BaseModel) -> str:
    """``model`` as one JSON line that no reader splits in two."""
    return model.model_dump_json().translate(_LINE_BREAKS) + "\n"


_MONO = FIELDS.index("mono_ns")
_EVENT_LINE = ('{"type":"event","index":%d,"kind":"%s",'
               + ",".join(f'"{f}":%d' for f in FIELDS[1:-1])
               + ',"wall_ns":%d,"error":%s}\n')
"""One event line: the JSON ``json.dumps`` writes for a DumpEvent's fields,
formatted in one step."""


def snapshot(path: Dumpable, reason: DumpReason, error: BaseException | None) -> Snapshot:
    rec = path.recorder
    clock = clock_pair()
    rows = rec.events()
    opened = entry(path)[1]
    world_id, world_size = world()
    header = DumpHeader(
        format_version=DUMP_FORMAT_VERSION, ppsync_version=_version(),
        torch_version=str(torch.__version__), rank=path.global_rank, group_rank=path.rank,
        group_ranks=path.group_ranks, pp_size=path.config.pp_size, config=path.config,
        host=socket.gethostname(), pid=os.getpid(), run_id=path.run_id,
        world_id=world_id, world_size=world_size or _world_size(path),
        opened_wall_ns=opened, clock=clock, reason=reason,
        capacity=rec.capacity, recorded=rec.recorded, dropped=rec.recorded - rows.shape[0],
    )
    err = error if error is not None else rec.last_error
    peer = getattr(err, "peer", None)
    footer = DumpFooter(
        error_type=None if err is None else type(err).__name__,
        error_message=None if err is None else str(err),
        error_peer=peer if isinstance(peer, int) else None,
        in_flight=rec.in_flight(clock.mono_ns), last_step=path.steps, next_seq=path.seq,
        closed=path.closed,
    )
    return Snapshot(header, rows, rec.recorded - rows.shape[0], list(rec.error_names), footer)


def _world_size(path: Dumpable) -> int:
    """torch.distributed's world size where the process joined one (its
    group's ranks lie in it), else 0: not known."""
    if dist.is_available() and dist.is_initialized():
        size = dist.get_world_size()
        if all(r < size for r in path.group_ranks):
            return size
    return 0
