"""Reading flight-recorder dumps: checking each line against the JSON
Schemas, and loading a dump into a :class:`RankDump`.

Validation uses the ``jsonschema`` library on the schemas exported from
``ppsync.schemas`` (the same documents as ``schemas/``, which a test keeps
equal to a fresh export), or on the files of a given schema directory.
"""

from __future__ import annotations

import json
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from jsonschema import Draft202012Validator
from jsonschema.exceptions import ValidationError as SchemaError
from pydantic import BaseModel, ValidationError

from ppsync.schemas.dump import DumpEvent, DumpFooter, DumpHeader
from ppsync.schemas.export import DUMP_LINE_SCHEMAS, schema_of

M = TypeVar("M", bound=BaseModel)


@dataclass(frozen=True, slots=True)
class Problem:
    """One line that breaks the schema."""

    file: str
    line: int  # 1-based
    field: str  # dotted path to the field, or "" for the whole line
    message: str

    def __str__(self) -> str:
        where = f"{self.file}:{self.line}"
        field = f" {self.field}:" if self.field else ""
        return f"{where}:{field} {self.message}"


def validators(schema_dir: Path | None = None) -> dict[str, Draft202012Validator]:
    """A validator per dump line type, from ``schema_dir`` or the models."""
    out = {}
    for line_type, name in DUMP_LINE_SCHEMAS.items():
        if schema_dir is None:
            schema = schema_of(name)
        else:
            schema = json.loads((schema_dir / f"{name}.schema.json").read_text())
        out[line_type] = Draft202012Validator(schema)
    return out


def _field_of(err: SchemaError) -> str:
    path = ".".join(str(p) for p in err.absolute_path)
    if err.validator == "additionalProperties" and isinstance(err.instance, dict):
        known = err.schema.get("properties", {}) if isinstance(err.schema, dict) else {}
        extra = sorted(k for k in err.instance if k not in known)
        names = ",".join(extra)
        return f"{path}.{names}" if path else names
    if err.validator == "required" and isinstance(err.validator_value, list):
        inst = err.instance if isinstance(err.instance, dict) else {}
        missing = [k for k in err.validator_value if k not in inst]
        names = ",".join(missing)
        return f"{path}.{names}" if path else names
    return path


class Unreadable(ValueError):
    """Raised when a file is not a dump: its message names the file and the
    line (``file:line: what``)."""


MAX_DUMP_BYTES = 512 << 20
"""The largest file a reader takes as a dump (the largest ring a config
allows dumps in well under it; see docs/flight-recorder.md)."""


def _read_regular(file: Path) -> bytes:
    """The bytes of ``file``, a regular file of at most MAX_DUMP_BYTES.
    Opened without blocking (a FIFO named like a dump would wait for a
    writer) and checked after the open (no race with a link swapped in):
    a FIFO, a device (a link to /dev/zero), a directory or an oversized
    file is Unreadable, never read."""
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
    try:
        fd = os.open(file, flags)
    except OSError as e:
        raise Unreadable(f"{file}: cannot read: {e.strerror or e}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise Unreadable(f"{file}: not a regular file ({_kind(st.st_mode)}): not a dump")
        if st.st_size > MAX_DUMP_BYTES:
            raise Unreadable(f"{file}: {st.st_size} bytes, more than a dump's "
                             f"{MAX_DUMP_BYTES}: not read")
        chunks, left = [], MAX_DUMP_BYTES + 1
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 22))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
    except OSError as e:
        raise Unreadable(f"{file}: cannot read: {e.strerror or e}") from None
    finally:
        os.close(fd)
    data = b"".join(chunks)
    if len(data) > MAX_DUMP_BYTES:  # grew after the fstat
        raise Unreadable(f"{file}: more than a dump's {MAX_DUMP_BYTES} bytes: not read")
    return data


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISDIR, "a directory"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return f"mode {mode:#o}"


def split_lines(text: str) -> list[str]:
    """``text``'s lines, split on "\\n" only (JSON Lines' separator; a
    str.splitlines() also splits at U+2028, U+2029, U+0085 and others, which
    a JSON string may hold raw), without the empty tail of a final newline."""
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    return lines


def _text_lines(file: Path) -> list[str]:
    """The file's lines, decoded; Unreadable naming the first line that is
    not UTF-8 text, or why the file cannot be read."""
    data = _read_regular(file)
    try:
        return split_lines(data.decode("utf-8"))
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise Unreadable(f"{file}:{line}: not text (byte {data[e.start]:#04x} is not "
                         "UTF-8): not a dump") from None


def _json(file: Path | str, line: int, text: str) -> object:
    """One line's JSON value; Unreadable naming the line when it is none."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise Unreadable(f"{file}:{line}: not JSON: {e}") from None
    except RecursionError:
        raise Unreadable(f"{file}:{line}: JSON nested too deeply to read") from None


def validate_file(file: Path, checks: dict[str, Draft202012Validator]) -> list[Problem]:
    """Every problem of one dump: a file that cannot be read or decoded,
    lines that are not JSON, break their schema, or come in the wrong order
    (header first, footer last)."""
    problems: list[Problem] = []
    name = str(file)
    try:
        lines = _text_lines(file)
    except Unreadable as e:
        where, _, why = str(e).partition(": ")
        line = where.rsplit(":", 1)[1] if where.count(":") else "0"
        return [Problem(name, int(line) if line.isdigit() else 0, "", why)]
    if not lines:
        return [Problem(name, 0, "", "empty file: a dump has a header and a footer line")]
    for i, text in enumerate(lines, start=1):
        try:
            doc = _json(name, i, text)
        except Unreadable as e:
            problems.append(Problem(name, i, "", str(e).split(": ", 1)[1]))
            continue
        kind = doc.get("type") if isinstance(doc, dict) else None
        want = "header" if i == 1 else "footer" if i == len(lines) else "event"
        if not isinstance(doc, dict):
            problems.append(Problem(name, i, "", f"a JSON {type(doc).__name__}, not an object"))
            continue
        if kind not in checks:
            problems.append(Problem(name, i, "type", f"{kind!r} is not one of "
                                    f"{sorted(checks)}"))
            continue
        if kind != want:
            problems.append(Problem(name, i, "type", f"{kind!r} where a {want!r} line belongs"))
        try:
            errors = sorted(checks[kind].iter_errors(doc), key=lambda e: list(e.absolute_path))
        except RecursionError:
            problems.append(Problem(name, i, "", "JSON nested too deeply to check"))
            continue
        for err in errors:
            problems.append(Problem(name, i, _field_of(err), err.message))
        if not errors:  # what the schema cannot say (a header's group facts): the model
            problems += _model_problems(name, i, _MODELS[kind], doc)
    if len(lines) == 1:
        problems.append(Problem(name, 1, "", "a header line alone: a dump ends with a "
                                "footer line"))
    return problems


_MODELS: dict[str, type[BaseModel]] = {"header": DumpHeader, "event": DumpEvent,
                                       "footer": DumpFooter}
"""The model that :func:`load` reads each line type with."""


def _model_problems(file: str, line: int, model: type[BaseModel], doc: object
                    ) -> list[Problem]:
    try:
        model.model_validate(doc)
    except ValidationError as e:
        return [Problem(file, line, ".".join(str(x) for x in err["loc"]), err["msg"])
                for err in e.errors()]
    except RecursionError:
        return [Problem(file, line, "", "JSON nested too deeply to check")]
    return []


@dataclass(frozen=True, slots=True)
class RankDump:
    """One rank's dump, loaded."""

    file: str
    header: DumpHeader
    events: list[dict[str, Any]]  # DumpEvent fields, oldest first
    footer: DumpFooter

    @property
    def rank(self) -> int:
        return self.header.rank

    @property
    def is_last(self) -> bool:
        return self.header.group_rank == self.header.pp_size - 1

    def wall_of(self, mono_ns: int) -> int:
        """Wall-clock ns of a monotonic reading of this rank's host."""
        c = self.header.clock
        return c.wall_ns + (mono_ns - c.mono_ns)


def _model(model: type[M], file: Path, line: int, doc: object) -> M:
    try:
        return model.model_validate(doc)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(x) for x in first["loc"])
        raise Unreadable(f"{file}:{line}: {where or 'line'}: {first['msg']}") from None
    except RecursionError:
        raise Unreadable(f"{file}:{line}: JSON nested too deeply to read") from None


def load(file: Path) -> RankDump:
    """Load a dump, every line checked against its model first; raises
    :class:`Unreadable` naming the file and the first bad line."""
    lines = [(i, t) for i, t in enumerate(_text_lines(file), start=1) if t.strip()]
    if len(lines) < 2:
        raise Unreadable(f"{file}:{len(lines)}: not a dump (a header line, events, "
                         "a footer line)")
    docs = [(i, _json(file, i, t)) for i, t in lines]
    header = _model(DumpHeader, file, *docs[0])
    footer = _model(DumpFooter, file, *docs[-1])
    events = []
    for i, doc in docs[1:-1]:
        events.append(_model(DumpEvent, file, i, doc).model_dump())
    return RankDump(str(file), header, events, footer)
