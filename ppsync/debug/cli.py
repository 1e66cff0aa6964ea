"""The ``ppsync dump`` and ``ppsync schema`` subcommands.

- ``ppsync dump validate FILE...``: every line against the JSON Schemas;
  exit 1 naming file, line and field of each problem.
- ``ppsync dump show FILE... [--json]``: merge a world's dumps, every PP
  group of it, and name the culprit (ppsync.debug.world_show, ppsync.debug.show).
- ``ppsync dump trace FILE... -o trace.json``: a Chrome/Perfetto timeline.
- ``ppsync schema export DIR``: write the JSON Schemas (ppsync.schemas.export).

A directory given as FILE stands for the ``ppsync-rank*.jsonl`` dumps in it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import stat
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from jsonschema import Draft202012Validator
from jsonschema.exceptions import SchemaError

from ppsync.debug.load import RankDump, Unreadable, load, validate_file, validators
from ppsync.debug.paths import check_output_dir, check_output_file
from ppsync.debug.trace import trace
from ppsync.debug.world_show import (
    WorldKey,
    analyse_world,
    describe,
    format_world,
    pick_world,
    world_groups,
)
from ppsync.errors import ConfigError
from ppsync.schemas.dump import DUMP_DIR_ENV
from ppsync.schemas.export import export


def _expand(files: list[Path]) -> list[Path]:
    """FILE arguments; a directory stands for the dumps in it."""
    out: list[Path] = []
    for f in files:
        out += sorted(f.glob("ppsync-rank*.jsonl")) if f.is_dir() else [f]
    return out


def _schema_checks(schemas: Path | None) -> dict[str, Draft202012Validator]:
    """The validators, from ``--schemas DIR`` when given: a missing directory
    or a schema file that cannot be read or is not a JSON Schema is a bad
    argument (exit 2), not a traceback."""
    if schemas is not None and not schemas.is_dir():
        raise ConfigError(f"--schemas {schemas}: not a directory (give the directory "
                          "`ppsync schema export` wrote)")
    try:
        checks = validators(schemas)
        for check in checks.values():
            type(check).check_schema(check.schema)
    except OSError as e:
        raise ConfigError(f"--schemas {schemas}: {e.filename}: {e.strerror}") from None
    except ValueError as e:  # json.JSONDecodeError
        raise ConfigError(f"--schemas {schemas}: a schema file is not JSON: {e}") from None
    except SchemaError as e:
        raise ConfigError(f"--schemas {schemas}: not a JSON Schema: {e.message}") from None
    return checks


def _validate(args: argparse.Namespace) -> int:
    checks = _schema_checks(args.schemas)
    bad = 0
    files = _expand(args.files)
    if not files:
        print("ppsync: no dump file given", file=sys.stderr)
        return 1
    for f in files:
        problems = validate_file(f, checks)
        for p in problems:
            print(p, file=sys.stderr)
        bad += bool(problems)
        if not problems:
            print(f"{f}: ok")
    return 1 if bad else 0


def _load_all(files: list[Path], wanted: int | None = None
              ) -> tuple[WorldKey | None, list[RankDump]]:
    """The readable dumps of one world (``wanted``: a world or run id, else
    the newest); every file skipped, and every other world ignored, is
    named on stderr."""
    dumps = []
    for f in _expand(files):
        try:
            dumps.append(load(f))
        except Unreadable as e:
            print(f"ppsync: skipping {e}", file=sys.stderr)
    if not dumps:
        print("ppsync: no dump could be read", file=sys.stderr)
        return None, []
    chosen, mine, others = pick_world(dumps, wanted)
    ignored = "; ignored " + ", ".join(f"{describe(k)} ({n} dump{'s' * (n > 1)})"
                                       for k, n in sorted(others.items())) if others else ""
    if chosen is None:
        print(f"ppsync: no dump of world or run {wanted:#x}{ignored}", file=sys.stderr)
        return None, []
    print(f"ppsync: {describe(chosen)}: {len(mine)} dump{'s' * (len(mine) != 1)}{ignored}",
          file=sys.stderr)
    return chosen, mine


def _show(args: argparse.Namespace) -> int:
    key, dumps = _load_all(args.files, args.run_id)
    if key is None:
        return 1
    report = analyse_world(dumps, key)
    if args.json:
        print(report.model_dump_json(indent=2))
    else:
        print(format_world(report))
    return SHOW_EXIT[report.verdict]


SHOW_EXIT = {"ok": 0, "failed": 1, "incomplete": 3, "stopped": 4}
"""``ppsync dump show``'s exit status by world verdict (1 also: no dump
could be read; 2: a bad argument)."""
SHOW_EXIT_HELP = ("exit status: 0 OK; 1 FAILED (or no dump could be read); 2 a bad argument; "
                  "3 INCOMPLETE (no error at hand, a rank's dump missing); 4 STOPPED (no "
                  "error at hand, the run ended by a signal)")


def _trace(args: argparse.Namespace) -> int:
    check_output_file("-o", args.output)
    key, dumps = _load_all(args.files, args.run_id)
    if key is None:
        return 1
    dumps = [d for g in world_groups(dumps) for d in g]
    doc = trace(dumps)
    try:
        args.output.write_text(json.dumps(doc) + "\n")
    except OSError as e:
        print(f"ppsync: -o {args.output}: not written: {e.strerror or e}", file=sys.stderr)
        return 1
    print(f"{args.output}: {len(doc['traceEvents'])} trace events from {len(dumps)} dumps "
          "(open in ui.perfetto.dev or chrome://tracing)")
    return 0


def _export(args: argparse.Namespace) -> int:
    check_output_dir("schema export", args.directory)
    try:
        written = export(args.directory)
    except OSError as e:
        raise ConfigError(f"schema export {args.directory}: {e.filename}: "
                          f"{e.strerror}") from None
    for path in written:
        print(path)
    return 0


def dump_files(dump_dir: Path | None) -> dict[str, tuple[int, int]]:
    """The regular dump files in ``dump_dir`` now: name -> (inode, mtime ns).
    A dump is written to a fresh file renamed into place, so every file a
    run writes differs from a snapshot taken before it."""
    out: dict[str, tuple[int, int]] = {}
    if dump_dir is None:
        return out
    with contextlib.suppress(OSError):
        for f in dump_dir.glob("ppsync-rank*.jsonl"):
            with contextlib.suppress(OSError):
                st = f.lstat()
                if stat.S_ISREG(st.st_mode):
                    out[f.name] = (st.st_ino, st.st_mtime_ns)
    return out


def point_at_dumps(dump_dir: Path | None,
                   before: Mapping[str, tuple[int, int]] | None = None) -> None:
    """The last lines of a failed run (``ppsync launch``, ``ppsync run``), on
    stderr: where the flight records are and the command that reads them.
    Only dump files written since ``before`` (:func:`dump_files` taken when
    the run started) are named: never an earlier run's, nor a directory
    standing where a dump belongs."""
    if dump_dir is None:
        print(f"ppsync: no flight records kept: rerun with --dump-dir DIR (or ${DUMP_DIR_ENV})",
              file=sys.stderr)
        return
    before = before or {}
    files = " ".join(str(dump_dir / n) for n, key in sorted(dump_files(dump_dir).items())
                     if before.get(n) != key)
    print(f"ppsync: flight records: {files or f'none written in {dump_dir}'}", file=sys.stderr)
    print(f"ppsync: diagnose with: ppsync dump show {dump_dir}/ppsync-rank*.jsonl",
          file=sys.stderr)


def _run_id(text: str) -> int:
    try:
        return int(text, 0)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a run id (an integer, "
                                         "e.g. 0x1f2e...)") from None


def add_debug_commands(sub: Any) -> None:
    """Add ``dump`` and ``schema`` to the ``ppsync`` parser's subparsers."""
    du = sub.add_parser("dump", help="read flight-recorder dumps")
    dsub = du.add_subparsers(dest="dump_command", required=True)
    va = dsub.add_parser("validate", help="check every line against the JSON Schemas")
    va.add_argument("files", type=Path, nargs="+", metavar="FILE")
    va.add_argument("--schemas", type=Path, default=None, metavar="DIR",
                    help="schema directory (default: the schemas of this ppsync)")
    va.set_defaults(run=_validate)
    sh = dsub.add_parser("show", help="merge a world's dumps (every PP group) and name "
                         "the culprit", epilog=SHOW_EXIT_HELP)
    sh.add_argument("files", type=Path, nargs="+", metavar="FILE")
    sh.add_argument("--json", action="store_true", help="print the report as JSON")
    sh.add_argument("--run", dest="run_id", type=_run_id, default=None, metavar="ID",
                    help="the world or run to read (its id, as show prints it; default "
                    "the newest)")
    sh.set_defaults(run=_show)
    tr = dsub.add_parser("trace", help="write a Chrome/Perfetto trace of the dumps")
    tr.add_argument("files", type=Path, nargs="+", metavar="FILE")
    tr.add_argument("-o", "--output", type=Path, required=True, metavar="FILE",
                    help="trace file to write (JSON)")
    tr.add_argument("--run", dest="run_id", type=_run_id, default=None, metavar="ID",
                    help="the world or run to read (default the newest)")
    tr.set_defaults(run=_trace)
    sc = sub.add_parser("schema", help="the JSON Schemas of dumps and reports")
    ssub = sc.add_subparsers(dest="schema_command", required=True)
    ex = ssub.add_parser("export", help="write one JSON Schema file per model")
    ex.add_argument("directory", type=Path, metavar="DIR")
    ex.set_defaults(run=_export)
