"""Optional extras: import a package that only some features need, or say which extra installs it.

``require("pyarrow.parquet", "data", "reading parquet")`` returns the module, or raises
:class:`MissingExtraError` — ``reading parquet needs pyarrow: pip install "attention-residuals[data]"``.
The ``attnres`` dispatcher prints that one line and exits 2. Floor 0: imports nothing of the project.
"""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["MissingExtraError", "require"]


class MissingExtraError(ImportError):
    """A feature's optional dependency is not installed; the message names the extra."""


def require(module: str, extra: str, what: str) -> ModuleType:
    """``importlib.import_module(module)``, or :class:`MissingExtraError` naming ``extra``."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        top = module.split(".")[0]
        raise MissingExtraError(
            f'{what} needs {top}, which is not installed: pip install "attention-residuals[{extra}]" ({exc})'
        ) from exc
