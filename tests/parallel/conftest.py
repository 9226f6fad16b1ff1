"""Fixtures for worker files: every rank collects the same tests, decided from the environment only."""
from __future__ import annotations

import pytest

from dualframe.launch.topology import detect


@pytest.fixture(scope="session")
def topology():
    """The launcher's view of this process (rank, size ...), read before any init."""
    return detect()
