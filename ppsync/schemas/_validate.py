"""Turn pydantic's ValidationError into ppsync's typed errors.

Each message names the field, the value and the rule, as the rest of ppsync
does, so a caller never has to know pydantic's exception type.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypeVar

from pydantic import BaseModel, ValidationError

from ppsync.errors import PPSyncError

M = TypeVar("M", bound=BaseModel)


def describe(err: ValidationError) -> str:
    """One line per broken rule: ``field = value: rule``."""
    parts = []
    for e in err.errors():
        field = ".".join(str(p) for p in e["loc"])
        if e["type"] == "missing":
            parts.append(f"{field}: required, not given")
        elif not e["loc"]:  # a rule across fields: its message names them
            parts.append(e["msg"].removeprefix("Value error, "))
        else:
            parts.append(f"{field} = {_short_repr(e.get('input'))}: {e['msg']}")
    return "; ".join(parts)


def _short_repr(value: object, limit: int = 80) -> str:
    """repr that never raises (an int of >4300 digits does) and stays short."""
    try:
        text = repr(value)
    except ValueError:
        text = f"<{type(value).__name__} too large to print>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def validate_as(model: type[M], data: Mapping[str, object], error: type[PPSyncError]) -> M:
    """``model.model_validate(data)``, raising ``error`` instead of pydantic's."""
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise error(f"invalid {model.__name__}: {describe(e)}") from None
