"""Sub-command tables and their dispatch, shared by ``attnres`` (:mod:`.cli`) and ``attnres bench``.

A table maps name -> (target, one-line help); the target is ``"module"`` (its ``main``) or
``"module:function"``, imported only when chosen, so a missing optional extra only matters for the
sub-command that needs it, and a missing extra met while running one is one line (exit 2). Low in the
import order: of the project it imports only :mod:`.extras`.

:class:`Parser` and :func:`fail` are how a command reports bad input: one line on stderr,
``<prog>: error: <what is wrong>``, and exit status 2 — never a traceback, never the long usage.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable
from typing import NoReturn

from .extras import MissingExtraError

__all__ = ["Help", "Parser", "dispatch", "error_line", "fail", "listing", "usage_text"]

Help = str | Callable[[], str]


def listing(module: str, table: str, template: str) -> Callable[[], str]:
    """A one-line help made, when shown, from the names of ``module.table`` (a sub-command table),
    so that the list cannot drift from the commands that exist: ``template`` holds one ``{}``."""

    def help_() -> str:
        try:
            names = getattr(importlib.import_module(module), table)
        except (ImportError, AttributeError):
            return template.format("...")
        return template.format(", ".join(names))

    return help_


def usage_text(prog: str, commands: dict[str, tuple[str, Help]], epilog: str = "") -> str:
    """The usage ``dispatch`` prints: each command with its one-line help (made now if a function)."""
    width = max(map(len, commands)) + 2
    return "\n".join(
        [f"usage: {prog} <command> [options]", "", "commands:"]
        + [
            f"  {name:<{width}}{help_() if callable(help_) else help_}"
            for name, (_, help_) in commands.items()
        ]
        + [
            "",
            f"Run `{prog} <command> --help` for the options of one command.{' ' + epilog if epilog else ''}",
        ]
    )


def dispatch(prog: str, commands: dict[str, tuple[str, Help]], argv: list[str], epilog: str = "") -> int:
    """Run ``prog <name> [options]``: ``commands`` maps name -> (target, one-line help), the target
    ``"module"`` (its ``main``) or ``"module:function"``, imported only when chosen; the function
    takes the remaining argv and returns an exit code. A help given as a function is called only
    when the usage is shown."""
    if not argv or argv[0] in ("-h", "--help"):
        print(usage_text(prog, commands, epilog))
        return 0
    name, rest = argv[0], argv[1:]
    if name not in commands:
        print(f"{prog}: unknown command {name!r}\n\n{usage_text(prog, commands, epilog)}", file=sys.stderr)
        return 2
    module_name, _, func_name = commands[name][0].partition(":")
    try:
        func = getattr(importlib.import_module(module_name), func_name or "main")
    except (ImportError, AttributeError) as exc:
        print(f"{prog} {name}: not available ({commands[name][0]}: {exc})", file=sys.stderr)
        return 2
    try:
        return int(func(rest) or 0)
    except MissingExtraError as exc:  # an optional extra a feature needs: its message names it
        print(f"{prog} {name}: error: {exc}", file=sys.stderr)
        return 2


def error_line(prog: str, error: BaseException | str) -> str:
    """``<prog>: error: <message>`` on one line (a message spanning lines is joined with ``; ``)."""
    text = "; ".join(line.strip() for line in str(error).splitlines() if line.strip())
    return f"{prog}: error: {text}"


def fail(prog: str, error: BaseException | str) -> int:
    """Print :func:`error_line` to stderr; returns 2, the exit status of bad input."""
    print(error_line(prog, error), file=sys.stderr)
    return 2


class Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line (:func:`error_line`, pointing at ``--help``)
    instead of the whole usage followed by the message; exit status 2 as argparse's."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, error_line(self.prog, f"{message} (see {self.prog} --help)") + "\n")
