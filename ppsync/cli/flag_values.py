"""Value parsers for the ``ppsync`` command's flags: a bad value is refused at
parsing, in one line naming the flag (argparse adds ``argument --flag:``).

A flag that sets a field of a pydantic model (SyncConfig, BenchOptions)
takes its bounds from that field's own constraints (``Field(ge=..., le=...)``),
read here: the model is the one place a bound is written. A non-number reads
as argparse words it: ``invalid int value: 'two'``. A flag's old spelling
(:class:`Renamed`) is refused in one line naming the new one.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Sequence
from typing import Any

from pydantic import BaseModel

from ppsync.schemas.bounds import field_bounds, rule_text


def bounded(kind: type[int] | type[float], low: float | None = None, high: float | None = None,
            *, low_in: bool = True, high_in: bool = True, unit: str = "",
            why: str = "") -> Callable[[str], Any]:
    """A parser of ``kind`` values within the given bounds."""
    rule = rule_text(low, low_in, high, high_in)

    def parse(text: str) -> int | float:
        v = kind(text)  # ValueError: argparse says "invalid int value: 'two'"
        if isinstance(v, float) and not math.isfinite(v):
            raise argparse.ArgumentTypeError(f"{text!r} must be a finite number")
        if ((low is not None and (v < low or (v == low and not low_in)))
                or (high is not None and (v > high or (v == high and not high_in)))):
            raise argparse.ArgumentTypeError(f"{v} must be {rule}{unit}{why}")
        return v

    parse.__name__ = kind.__name__  # argparse names the type in its message
    return parse


def from_field(model: type[BaseModel], name: str, *, low: float | None = None,
               why: str = "") -> Callable[[str], Any]:
    """The parser of a flag that sets ``model.name``: its type and bounds
    from the field (``low`` raises the lower bound for this flag: ``why``
    says why)."""
    field_low, low_in, high, high_in = field_bounds(model, name)
    annotation = model.model_fields[name].annotation
    kind: type[int] | type[float] = float if annotation in (float, float | None) else int
    if low is not None:
        field_low, low_in = low, True
    return bounded(kind, field_low, high, low_in=low_in, high_in=high_in, why=why)


def at_least(low: int) -> Callable[[str], Any]:
    """An int >= ``low`` (a flag no model bounds)."""
    return bounded(int, low)


class Renamed(argparse.Action):
    """A flag's old spelling: no alias (no release has shipped under it), one
    line naming the new one, exit 2."""

    def __init__(self, option_strings: Sequence[str], dest: str, *, new: str,
                 **_: Any) -> None:
        self.new = new
        super().__init__(option_strings, argparse.SUPPRESS, nargs="?",
                         default=argparse.SUPPRESS, help=argparse.SUPPRESS)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: object, option_string: str | None = None) -> None:
        parser.exit(2, f"{parser.prog}: error: {option_string} is now {self.new}\n")
