"""Old module paths from before the core was grouped by concept, kept importable with a DeprecationWarning.

``import dualframe.timeline`` (and the other flat names below) still works and returns the module at its
new home, so scripts written against earlier releases keep running; the warning names the new path.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from types import ModuleType
from typing import Optional, Sequence

# old name under ``dualframe.`` -> new module path
MOVED = {
    "protocols": "dualframe.backend",
    "compression": "dualframe.dp.compression",
    "dp_checks": "dualframe.dp.checks",
    "scaling": "dualframe.dp.scaling",
    "partition": "dualframe.pipeline.partition",
    "microbatch": "dualframe.pipeline.microbatch",
    "split": "dualframe.pipeline.split",
    "rank_schedule": "dualframe.pipeline.schedule",
    "schedule": "dualframe.pipeline.executor",
    "stage_runner": "dualframe.pipeline.walk",
    "stage_link": "dualframe.pipeline.link",
    "stage_process": "dualframe.pipeline.stage",
    "stage_setup": "dualframe.pipeline.layout",
    "mpi_direct": "dualframe.pipeline.mpi_direct",
    "failure": "dualframe.reliability.failure",
    "checkpoint": "dualframe.reliability.checkpoint",
    "stage_checkpoint": "dualframe.reliability.stage_checkpoint",
    "topology": "dualframe.launch.topology",
    "run": "dualframe.launch.run",
    "doctor": "dualframe.launch.doctor",
    "mpi_defaults": "dualframe.launch.mpi_defaults",
    "timeline": "dualframe.observe.timeline",
    "charts": "dualframe.observe.charts",
    "horovod_timeline": "dualframe.observe.horovod_timeline",
    "bench_rounds": "dualframe.observe.bench_rounds",
}


class _AliasLoader(importlib.abc.Loader):
    """Loads an old name as the module at its new path (the same object, not a copy)."""

    def __init__(self, new: str) -> None:
        self.new = new

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        warnings.warn(f"{spec.name} moved to {self.new}; import it from there", DeprecationWarning, stacklevel=3)
        return importlib.import_module(self.new)

    def exec_module(self, module: ModuleType) -> None:
        """Nothing to run: the module was executed at its new path."""


class _MovedFinder(importlib.abc.MetaPathFinder):
    """Finds ``dualframe.<old name>`` for the names in MOVED."""

    def find_spec(self, fullname: str, path: Optional[Sequence[str]] = None,
                  target: Optional[ModuleType] = None) -> Optional[importlib.machinery.ModuleSpec]:
        prefix, _, leaf = fullname.rpartition(".")
        if prefix != "dualframe" or leaf not in MOVED:
            return None
        return importlib.machinery.ModuleSpec(fullname, _AliasLoader(MOVED[leaf]))


def install() -> None:
    """Put the finder on ``sys.meta_path`` once."""
    if not any(isinstance(finder, _MovedFinder) for finder in sys.meta_path):
        sys.meta_path.append(_MovedFinder())
