"""Reading flight-recorder dumps (``ppsync dump``): validate them against the
JSON Schemas, merge a group's dumps and name the culprit, and export a
Chrome/Perfetto timeline. A user of the library, like an engine: it reads
files and imports only ``ppsync.schemas`` below it."""

from ppsync.debug.load import Problem, RankDump, load, validate_file, validators
from ppsync.debug.show import GroupReport, analyse, format_report, group_dumps
from ppsync.debug.trace import trace

__all__ = [
    "GroupReport",
    "Problem",
    "RankDump",
    "analyse",
    "format_report",
    "group_dumps",
    "load",
    "trace",
    "validate_file",
    "validators",
]
