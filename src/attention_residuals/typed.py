"""Floor 0: typed dataclass configs with one home per option.

A config option is a dataclass field made by :func:`option`: its default, its help text and its
choices sit together in the field, and everything else reads them from there — validation
(:func:`check_field_types`, :func:`check_choices`, :func:`check_bounds`), the command line
(``training.args`` makes one flag per field, nested dataclasses flattened) and the docs. No second
table of names to drift.

A field's range sits in the field too (``option(1.0, "...", ge=0)``: the ``ge``/``gt``/``le``/``lt``
bounds of pydantic's ``Field``), and :func:`check_number` is the one check of a number every
entry point uses — library constructors, a JSON config, the command line, ``generate``: a bool is
no number, a float must be finite (NaN passes no comparison, so ``grad_clip=nan`` would otherwise
slip through ``< 0`` and switch clipping off), and the bounds hold.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Callable
from dataclasses import MISSING, field, fields
from typing import Any

__all__ = [
    "check_bounds",
    "check_choices",
    "check_field_types",
    "check_number",
    "choices_of",
    "field_default",
    "flat_name",
    "is_config_class",
    "option",
    "optional_type",
]


def option(
    default: Any,
    help: str,
    *,
    choices: tuple[str, ...] | Callable[[], tuple[str, ...]] | None = None,
    flag: str | None = None,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
    **meta: Any,
) -> Any:
    """A dataclass field with its help text (and choices, a flag name other than the field's, the
    bounds :func:`check_bounds` enforces) kept beside the default. ``choices`` may be a function
    returning them (a registry filled later). A list or dict default is copied per instance."""
    bounds = {k: v for k, v in (("ge", ge), ("gt", gt), ("le", le), ("lt", lt)) if v is not None}
    metadata = {"help": help, "choices": choices, "flag": flag, "bounds": bounds, **meta}
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


def is_config_class(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


# the values each annotated field type accepts (an int passes for a float; a bool is no number)
_TYPE_CHECKS = {
    bool: lambda v: isinstance(v, bool),
    int: lambda v: isinstance(v, int) and not isinstance(v, bool),
    float: lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    str: lambda v: isinstance(v, str),
}


def _article(name: str) -> str:
    return "an" if name[0] in "aeiou" else "a"


def check_field_types(config: Any) -> None:
    """Every field of the dataclass ``config`` (nested dataclasses included) holds a value of its
    annotated type: a JSON ``"key_norm": "false"`` or ``"lr": "fast"`` fails here, naming the
    option by its flat name, instead of being taken as true or failing deep inside."""
    hints = typing.get_type_hints(type(config))
    for f in fields(config):
        value = getattr(config, f.name)
        tp, optional = optional_type(hints[f.name])
        if optional and value is None:
            continue
        if is_config_class(tp):
            if not isinstance(value, tp):
                raise ValueError(f"{f.name}: expected {_article(tp.__name__)} {tp.__name__}, got {value!r}")
            check_field_types(value)
            continue
        ok = _TYPE_CHECKS.get(tp)
        if ok is not None and not ok(value):
            raise ValueError(
                f"{flat_name(f)}: expected {_article(tp.__name__)} {tp.__name__}"
                f"{' or None' if optional else ''}, got {value!r}"
            )


def flat_name(f: dataclasses.Field) -> str:
    """``metadata["flag"]`` (``"residual"`` or ``"--residual"``) as a name, else the field's name."""
    flag = f.metadata.get("flag")
    return flag.lstrip("-").replace("-", "_") if flag else f.name


def choices_of(f: dataclasses.Field) -> tuple[str, ...] | None:
    """The choices a field declares (called when given as a function), or ``None``."""
    choices = f.metadata.get("choices")
    return tuple(choices()) if callable(choices) else choices


_BOUND_WORDS = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<"}
_BOUND_TESTS = {
    "ge": lambda v, b: v >= b,
    "gt": lambda v, b: v > b,
    "le": lambda v, b: v <= b,
    "lt": lambda v, b: v < b,
}


def _expected(integer: bool, bounds: dict[str, float], optional: bool) -> str:
    kind = "an integer" if integer else "a finite number"
    rule = " and ".join(
        f"{_BOUND_WORDS[k]} {b if isinstance(b, int) else f'{b:g}'}" for k, b in bounds.items()
    )
    return f"{kind}{' ' + rule if rule else ''}{' or None' if optional else ''}"


def check_number(
    name: str,
    value: Any,
    *,
    integer: bool = False,
    optional: bool = False,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
) -> None:
    """``value`` is a number (an int when ``integer``; a bool is neither; a float is finite)
    within the bounds, or None when ``optional``. Raises ``ValueError`` naming ``name`` and what
    was expected: ``grad_clip: expected a finite number >= 0, got nan``."""
    if optional and value is None:
        return
    bounds = {k: v for k, v in (("ge", ge), ("gt", gt), ("le", le), ("lt", lt)) if v is not None}
    ok = isinstance(value, int) if integer else isinstance(value, int | float)
    ok = ok and not isinstance(value, bool)
    ok = ok and (integer or math.isfinite(value))
    if not (ok and all(_BOUND_TESTS[k](value, b) for k, b in bounds.items())):
        raise ValueError(f"{name}: expected {_expected(integer, bounds, optional)}, got {value!r}")


def check_bounds(config: Any) -> None:
    """Every number field of the dataclass ``config`` (nested dataclasses included) is finite and
    within the bounds its :func:`option` declares (:func:`check_number`); run after
    :func:`check_field_types`, so the types are known."""
    hints = typing.get_type_hints(type(config))
    for f in fields(config):
        value = getattr(config, f.name)
        tp, optional = optional_type(hints[f.name])
        if is_config_class(tp) and isinstance(value, tp):
            check_bounds(value)
        elif tp in (int, float):
            bounds = f.metadata.get("bounds") or {}
            check_number(flat_name(f), value, integer=tp is int, optional=optional, **bounds)


def check_choices(config: Any) -> None:
    """Every field that declares ``choices`` holds one of them."""
    for f in fields(config):
        choices = choices_of(f)
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
