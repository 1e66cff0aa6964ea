"""Reading flight-recorder dumps (``ppsync dump``): validate them against the
JSON Schemas, merge a world's dumps (every PP group) and name the culprit, and export a
Chrome/Perfetto timeline. A user of the library, like an engine: it reads
files and imports only ``ppsync.schemas`` below it."""

from ppsync.debug.load import Problem, RankDump, load, validate_file, validators
from ppsync.debug.show import GroupReport, analyse, format_report, group_dumps
from ppsync.debug.trace import trace
from ppsync.debug.world_show import WorldReport, analyse_world, format_world, pick_world

__all__ = [
    "GroupReport",
    "Problem",
    "RankDump",
    "WorldReport",
    "analyse",
    "analyse_world",
    "format_report",
    "format_world",
    "group_dumps",
    "load",
    "pick_world",
    "trace",
    "validate_file",
    "validators",
]
