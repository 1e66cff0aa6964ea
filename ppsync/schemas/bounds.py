"""A model field's numeric bounds, read from its own constraints
(``Field(ge=..., le=...)``): the model is the one place a bound is written;
flags (ppsync.cli.flag_values) and environment variables (ppsync.compat.env)
read it here and word it the same way."""

from __future__ import annotations

from pydantic import BaseModel


def field_bounds(model: type[BaseModel], name: str) -> tuple[float | None, bool,
                                                              float | None, bool]:
    """(low, low inclusive, high, high inclusive) of ``model.name``'s
    numeric constraints (None: unbounded on that side)."""
    low: float | None = None
    high: float | None = None
    low_in = high_in = True
    for m in model.model_fields[name].metadata:
        if getattr(m, "ge", None) is not None:
            low, low_in = m.ge, True
        if getattr(m, "gt", None) is not None:
            low, low_in = m.gt, False
        if getattr(m, "le", None) is not None:
            high, high_in = m.le, True
        if getattr(m, "lt", None) is not None:
            high, high_in = m.lt, False
    return low, low_in, high, high_in


def rule_text(low: float | None, low_in: bool, high: float | None, high_in: bool) -> str:
    """The rule as a message words it: "in (0, 86400]", ">= 2"."""
    def g(v: float) -> str:
        return str(int(v)) if float(v).is_integer() else f"{v:g}"

    if low is not None and high is not None:
        return f"in {'[' if low_in else '('}{g(low)}, {g(high)}{']' if high_in else ')'}"
    if low is not None:
        return f"{'>=' if low_in else '>'} {g(low)}"
    if high is not None:
        return f"{'<=' if high_in else '<'} {g(high)}"
    return "a number"


def within(value: float, bounds: tuple[float | None, bool, float | None, bool]) -> bool:
    """Whether ``value`` (finite) lies within ``bounds`` (:func:`field_bounds`)."""
    low, low_in, high, high_in = bounds
    return not ((low is not None and (value < low or (value == low and not low_in)))
                or (high is not None and (value > high or (value == high and not high_in))))
