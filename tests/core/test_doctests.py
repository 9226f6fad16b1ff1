"""Every ``>>>`` example in the framework-neutral core runs and shows what it says (adapters: their own suites)."""
from __future__ import annotations

import doctest
import importlib
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
ADAPTERS = ("torch", "tensorflow")
MODULES = sorted(
    ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
    for path in (ROOT / "dualframe").rglob("*.py")
    if path.relative_to(ROOT / "dualframe").parts[0] not in ADAPTERS and path.name not in ("__main__.py", "keras.py")
)


def test_the_core_has_examples() -> None:
    examples = sum(len(t.examples) for name in MODULES for t in doctest.DocTestFinder().find(importlib.import_module(name)))
    assert examples >= 100, f"only {examples} doctest examples found in the core"


@pytest.mark.parametrize("name", MODULES)
def test_examples_run(name: str) -> None:
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples in {name} failed (output above)"
