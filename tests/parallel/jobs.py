"""A job as an outer test starts it: a launcher's command in a session of its own, bounded by a timeout.

Framework-free (no torch, no TensorFlow): tests/parallel/test_*.py import it by its bare name (pytest
puts their folder on sys.path), tests/cluster/_cluster.py as ``tests.parallel.jobs`` (PYTHONPATH is
the repository root). Not a worker: its name does not start with ``mp_``.
"""
from __future__ import annotations

import os
import signal
import subprocess
from typing import Mapping, Sequence, Tuple, Union

import pytest

PathLike = Union[str, "os.PathLike[str]"]


def run_bounded(command: Sequence[str], env: Mapping[str, str], cwd: PathLike, timeout: float,
                what: str) -> Tuple[int, str]:
    """Run ``command`` (stdout and stderr together) in a session of its own; return (exit status, output).

    Past ``timeout`` seconds the whole session (a launcher and every rank it started) is SIGKILLed
    and the test fails, saying ``what`` hung and showing the end of its output.
    """
    process = subprocess.Popen(list(command), cwd=cwd, env=dict(env), stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        pytest.fail(f"{what} hung past {timeout:.0f} s:\n{output[-6000:]}")
    return process.returncode, output
