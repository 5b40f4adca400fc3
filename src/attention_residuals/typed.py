"""Floor 0: typed dataclass configs with one home per option.

A config option is a dataclass field made by :func:`option`: its default, its help text and its
choices sit together in the field, and everything else reads them from there — validation
(:func:`check_field_types`, :func:`check_choices`), the command line (``training.args`` makes one
flag per field, nested dataclasses flattened) and the docs. No second table of names to drift.
"""

from __future__ import annotations

import types
import typing
from dataclasses import MISSING, field, fields
from typing import Any

__all__ = ["option", "optional_type", "check_field_types", "check_choices", "field_default"]


def option(default: Any, help: str, *, choices: tuple[str, ...] | None = None, flag: str | None = None,
           **meta: Any) -> Any:
    """A dataclass field with its help text (and choices, a flag name other than the field's) kept
    beside the default. A list or dict default is copied per instance."""
    metadata = {"help": help, "choices": choices, "flag": flag, **meta}
    if isinstance(default, list | dict):
        return field(default_factory=lambda: type(default)(default), metadata=metadata)
    return field(default=default, metadata=metadata)


def optional_type(tp: Any) -> tuple[Any, bool]:
    """``(inner type, True)`` for ``X | None`` (``Any`` when several types remain), else ``(tp, False)``."""
    args = typing.get_args(tp)
    if typing.get_origin(tp) in (typing.Union, types.UnionType) and type(None) in args:
        inner = [a for a in args if a is not type(None)]
        return (inner[0] if len(inner) == 1 else Any), True
    return tp, False


# the values each annotated field type accepts (an int passes for a float; a bool is no number)
_TYPE_CHECKS = {
    bool: lambda v: isinstance(v, bool),
    int: lambda v: isinstance(v, int) and not isinstance(v, bool),
    float: lambda v: isinstance(v, int | float) and not isinstance(v, bool),
    str: lambda v: isinstance(v, str),
}


def check_field_types(config: Any) -> None:
    """Every field of the dataclass ``config`` holds a value of its annotated type: a JSON
    ``"key_norm": "false"`` or ``"lr": "fast"`` fails here, naming the field, instead of being
    taken as true or failing deep inside. Fields of another type (nested configs) are left to
    their own checks."""
    hints = typing.get_type_hints(type(config))
    for f in fields(config):
        value = getattr(config, f.name)
        tp, optional = optional_type(hints[f.name])
        if optional and value is None:
            continue
        ok = _TYPE_CHECKS.get(tp)
        if ok is not None and not ok(value):
            article = "an" if tp.__name__[0] in "aeiou" else "a"
            raise ValueError(
                f"{f.name}: expected {article} {tp.__name__}{' or None' if optional else ''}, got {value!r}"
            )


def check_choices(config: Any) -> None:
    """Every field that declares ``choices`` holds one of them."""
    for f in fields(config):
        choices = f.metadata.get("choices")
        value = getattr(config, f.name)
        if choices and value not in choices:
            raise ValueError(f"{f.name}: expected one of {tuple(choices)}, got {value!r}")


def field_default(f: Any) -> Any:
    """The default of a dataclass field (``MISSING`` when it has none)."""
    if f.default is not MISSING:
        return f.default
    if f.default_factory is not MISSING:
        return f.default_factory()
    return MISSING
