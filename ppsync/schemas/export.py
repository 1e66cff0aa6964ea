"""The JSON Schemas of ppsync's documents, exported from the pydantic models.

``schemas/`` at the top of the repository holds one file per model
(``ppsync schema export schemas``); a test fails when it differs from a
fresh export. The schemas describe documents as ppsync writes them
(pydantic's serialization mode: every field is present).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from ppsync.schemas.bench import BenchReport
from ppsync.schemas.dump import DumpEvent, DumpFooter, DumpHeader
from ppsync.schemas.run_report import RunReport

DIALECT = "https://json-schema.org/draft/2020-12/schema"

MODELS: dict[str, type[BaseModel]] = {
    "dump-header": DumpHeader,
    "dump-event": DumpEvent,
    "dump-footer": DumpFooter,
    "run-report": RunReport,
    "bench-report": BenchReport,
}
"""Schema name -> model; the file is ``<name>.schema.json``."""

DUMP_LINE_SCHEMAS = {"header": "dump-header", "event": "dump-event", "footer": "dump-footer"}
"""A dump line's ``type`` -> the schema it follows."""


def schema_of(name: str) -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of model ``name``."""
    body = MODELS[name].model_json_schema(mode="serialization")
    return {"$schema": DIALECT, "$id": f"{name}.schema.json", **body}


def export(directory: Path) -> list[Path]:
    """Write every schema into ``directory``; return the files written."""
    directory.mkdir(parents=True, exist_ok=True)
    out = []
    for name in MODELS:
        path = directory / f"{name}.schema.json"
        path.write_text(json.dumps(schema_of(name), indent=2, sort_keys=True) + "\n")
        out.append(path)
    return out
