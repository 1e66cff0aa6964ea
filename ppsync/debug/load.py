"""Reading flight-recorder dumps: checking each line against the JSON
Schemas, and loading a dump into a :class:`RankDump`.

Validation uses the ``jsonschema`` library on the schemas exported from
``ppsync.schemas`` (the same documents as ``schemas/``, which a test keeps
equal to a fresh export), or on the files of a given schema directory.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jsonschema import Draft202012Validator
from jsonschema.exceptions import ValidationError

from ppsync.schemas.dump import DumpFooter, DumpHeader
from ppsync.schemas.export import DUMP_LINE_SCHEMAS, schema_of


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


def _field_of(err: ValidationError) -> str:
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


def validate_file(file: Path, checks: dict[str, Draft202012Validator]) -> list[Problem]:
    """Every problem of one dump: lines that are not JSON, break their
    schema, or come in the wrong order (header first, footer last)."""
    problems: list[Problem] = []
    name = str(file)
    try:
        lines = file.read_text().splitlines()
    except OSError as e:
        return [Problem(name, 0, "", f"cannot read: {e}")]
    if not lines:
        return [Problem(name, 0, "", "empty file: a dump has a header and a footer line")]
    for i, text in enumerate(lines, start=1):
        try:
            doc = json.loads(text)
        except json.JSONDecodeError as e:
            problems.append(Problem(name, i, "", f"not JSON: {e}"))
            continue
        kind = doc.get("type") if isinstance(doc, dict) else None
        want = "header" if i == 1 else "footer" if i == len(lines) else "event"
        if kind not in checks:
            problems.append(Problem(name, i, "type", f"{kind!r} is not one of "
                                    f"{sorted(checks)}"))
            continue
        if kind != want:
            problems.append(Problem(name, i, "type", f"{kind!r} where a {want!r} line belongs"))
        for err in sorted(checks[kind].iter_errors(doc), key=lambda e: list(e.absolute_path)):
            problems.append(Problem(name, i, _field_of(err), err.message))
    return problems


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


def load(file: Path) -> RankDump:
    """Load a dump (ValueError when it has no header or footer line)."""
    lines = [json.loads(t) for t in file.read_text().splitlines() if t.strip()]
    if len(lines) < 2 or lines[0].get("type") != "header" or lines[-1].get("type") != "footer":
        raise ValueError(f"{file}: not a dump (a header line, events, a footer line)")
    return RankDump(str(file), DumpHeader.model_validate(lines[0]), lines[1:-1],
                    DumpFooter.model_validate(lines[-1]))
