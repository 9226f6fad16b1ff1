"""Importing a framework or Horovod with an error that says how to get it."""
from __future__ import annotations

import importlib
from types import ModuleType

from dualframe.errors import MissingDependencyError

FIX = "run `bash scripts/bootstrap.sh` in the dualframe checkout (or see README: Install)"


def require(module: str, what: str) -> ModuleType:
    """Import ``module`` or raise MissingDependencyError naming ``what`` and the fix."""
    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise MissingDependencyError(f"{what} is not importable ({module}: {error}); {FIX}") from error
