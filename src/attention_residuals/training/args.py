"""The ``attnres train`` command line, built from the config dataclasses.

:func:`add_flags` gives every leaf option of a tree of dataclasses (:func:`.config.flat_fields`:
nested dataclass fields are flattened, ``metadata["flag"]`` renames one) a flat flag —
``--d-model``, ``--residual``; booleans get ``--x/--no-x``, ``metadata["switch"]`` fields a plain
``--x`` — with its help, default and choices from the field's metadata. Defaults are suppressed,
so the parsed namespace holds only the flags given; :func:`.config.replace_flat` applies them to a
base config and rebuilds the nested values. :func:`to_flags` is the inverse: the flags that
reproduce a config. :func:`build_parser`, :func:`read_config` and :func:`config_from_args` are
the ``attnres train`` instances.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from ..commands import Parser
from ..typed import choices_of, optional_type
from .config import FlatField, TrainConfig, flat_fields, get_path
from .prepare import data_vocab_size

__all__ = ["add_flags", "build_parser", "config_from_args", "flag_words", "read_config", "to_flags"]


def _help(ff: FlatField) -> str:
    return ff.meta.get("help") or f"{ff.owner.__name__}.{ff.path[-1]}"


def _choices(ff: FlatField) -> Iterable[str] | None:
    return choices_of(ff.field)


def _none_or(conv):
    def parse(s: str):
        return None if s.lower() in ("none", "null") else conv(s)

    parse.__name__ = getattr(conv, "__name__", "value")
    return parse


def _arg_type(tp: Any):
    """(argparse type, is_bool) for a resolved dataclass field type."""
    inner, optional = optional_type(tp)
    if optional:
        base, is_bool = (json.loads, False) if inner is Any else _arg_type(inner)
        return _none_or(base), is_bool
    if tp is bool:
        return None, True
    if tp in (int, float, str):
        return tp, False
    return json.loads, False


def _add_flag(group: Any, ff: FlatField, default: Any) -> None:
    conv, is_bool = _arg_type(ff.type)
    text = _help(ff)
    if is_bool and ff.meta.get("switch"):
        group.add_argument(ff.flag, action="store_true", default=argparse.SUPPRESS, dest=ff.name, help=text)
    elif is_bool:
        group.add_argument(
            ff.flag,
            action=argparse.BooleanOptionalAction,
            default=argparse.SUPPRESS,
            dest=ff.name,
            help=f"{text} (default: {default})",
        )
    else:
        choices = _choices(ff)
        kw: dict[str, Any] = {"type": conv, "default": argparse.SUPPRESS, "dest": ff.name}
        if choices:
            kw["choices"] = list(choices)
            kw["metavar"] = "{" + ",".join(choices) + "}"
        else:
            kw["metavar"] = ff.name.upper()
        group.add_argument(ff.flag, help=f"{text} (default: {default})", **kw)


def add_flags(
    parser: Any,
    cls: type,
    group_for: Callable[[FlatField], Any] | None = None,
    only: Iterable[str] | None = None,
) -> None:
    """One flag per leaf option of the dataclass ``cls`` (whose fields all have defaults), into
    ``group_for(leaf)`` or ``parser`` (``only``: those flat names alone). The namespace gets only
    the flags given, by flat name."""
    defaults = cls()
    keep = None if only is None else set(only)
    for ff in flat_fields(cls):
        if keep is None or ff.name in keep:
            _add_flag(group_for(ff) if group_for else parser, ff, get_path(defaults, ff.path))


def flag_words(ff: FlatField, value: Any) -> list[str]:
    """The command-line words setting the option ``ff`` to ``value`` (none for an off switch)."""
    if isinstance(value, bool):
        if not value and ff.meta.get("switch"):
            return []
        return [ff.flag if value else "--no-" + ff.name.replace("_", "-")]
    if value is None:
        return [ff.flag, "none"]
    return [ff.flag, str(value) if isinstance(value, int | float | str) else json.dumps(value)]


def to_flags(
    obj: Any, *, always: Iterable[str] = (), skip: Callable[[FlatField], bool] | None = None
) -> list[str]:
    """The flags reproducing the dataclass ``obj`` from its class's defaults: its non-default
    options plus those named in ``always``, except the ``skip`` ones not in ``always``."""
    base, always = type(obj)(), set(always)
    words: list[str] = []
    for ff in flat_fields(type(obj)):
        value = get_path(obj, ff.path)
        if ff.name not in always and ((skip is not None and skip(ff)) or value == get_path(base, ff.path)):
            continue
        words += flag_words(ff, value)
    return words


# --------------------------------------------------------------------------- attnres train


def build_parser(prog: str = "attnres train") -> argparse.ArgumentParser:
    """The ``attnres train`` parser: one flag per option of TrainConfig and its GPTConfig."""
    p = Parser(
        prog=prog,
        description="Train a GPT whose depth mixing is any residual rule (PreNorm baseline, Full / Block "
        "AttnRes, DenseFormer, mHC, depth-SWA, mixing). The run directory holds config.json, "
        "metrics.jsonl, checkpoint.safetensors and, when done, summary.json.",
        epilog="examples:\n"
        "  attnres train --out runs/base --steps 2000\n"
        "  attnres train --residual block --n-blocks 4 --d-model 128 --out runs/block\n"
        "  attnres train --out runs/x --steps 2000 --stop-at 1000   # later: the same with --resume\n"
        "  attnres train --data corpus/ --seq-len 512 --optimizer muon --schedule wsd --out runs/wsd",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--config",
        metavar="JSON",
        default=None,
        help="start from this config (e.g. a run's config.json); the other flags override it",
    )
    groups = {
        "model": p.add_argument_group("model"),
        "training": p.add_argument_group("training"),
        "run": p.add_argument_group("run control (not part of the run's identity)"),
    }

    def group_for(ff: FlatField) -> Any:
        if ff.path[0] == "model":
            return groups["model"]
        return groups["run" if ff.meta.get("run_control") else "training"]

    add_flags(p, TrainConfig, group_for)
    return p


def _model_names() -> set[str]:
    return {ff.name for ff in flat_fields(TrainConfig) if ff.path[0] == "model"}


def read_config(path: str | os.PathLike) -> tuple[TrainConfig, set[str]]:
    """A config file: a run's ``config.json`` (sections ``model``, ``train``, ``run``) or one flat
    object of fields (``{"d_model": 64, "steps": 500}``). Returns it and the model fields it sets;
    ``ValueError`` / ``FileNotFoundError`` name the file and what is wrong."""
    try:
        d = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"--config {str(path)!r}: no such file") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"--config {str(path)!r}: not a JSON file ({e})") from None
    if not isinstance(d, dict):
        raise ValueError(f"--config {str(path)!r}: expected a JSON object, got a {type(d).__name__}")
    sections = {"model", "train", "run"}
    try:
        if sections & set(d):
            other = set(d) - sections - {"format", "data", "command"}  # the rest of a run's config.json
            if other:
                raise ValueError(f"unknown sections {sorted(other)} beside {sorted(sections & set(d))}")
            return TrainConfig.from_dict(d), set(d.get("model", {}))
        return TrainConfig().replace(**d), set(d) & _model_names()
    except (TypeError, ValueError) as e:
        raise ValueError(f"--config {str(path)!r}: {e}") from None


def config_from_args(argv: list[str] | None = None) -> TrainConfig:
    """Parse ``attnres train`` arguments into a :class:`TrainConfig` (argparse errors exit 2).

    With no vocabulary size given, the model's is what the data needs (:func:`.prepare.data_vocab_size`:
    the tokenizer's; 257 for byte tokens with an end-of-text id)."""
    ns = vars(build_parser().parse_args(argv))
    base, given = TrainConfig(), set(ns)
    path = ns.pop("config", None)
    if path:
        base, in_file = read_config(path)
        given |= in_file
    cfg = base.replace(**ns)
    if "vocab_size" not in given and (vocab := data_vocab_size(cfg)) is not None:
        cfg = cfg.replace(vocab_size=vocab)
    return cfg
