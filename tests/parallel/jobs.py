"""A job as an outer test starts it: a launcher's command in a session of its own, bounded by a timeout.

Framework-free (no torch, no TensorFlow): tests/parallel/test_*.py import it by its bare name (pytest
puts their folder on sys.path), tests/cluster/_cluster.py as ``tests.parallel.jobs`` (PYTHONPATH is
the repository root). Not a worker: its name does not start with ``mp_``.
"""
from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
from typing import Dict, List, Mapping, Sequence, Tuple, Union

import pytest

from dualframe.launch.commands import horovodrun_command, mpirun_command, thread_env

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


def two_rank_job(worker: PathLike, launcher: str, root: PathLike, **variables: str) -> Tuple[List[str], Dict[str, str]]:
    """The command and environment that run ``worker`` on 2 local ranks under ``launcher`` ("horovodrun": Gloo,
    or "mpirun"), one thread each, with this repository on PYTHONPATH and ``variables`` reaching every rank."""
    program, bindir = [sys.executable, str(worker)], pathlib.Path(sys.executable).parent
    if launcher == "horovodrun":
        command = horovodrun_command(2, program, horovodrun=str(bindir / "horovodrun"))
    else:
        command = mpirun_command(2, program, oversubscribe=True,
                                 export=("PATH", "PYTHONPATH", "TF_CPP_MIN_LOG_LEVEL", *variables, *thread_env(1)))
    env = dict(os.environ, PYTHONPATH=str(root), PYTHONUNBUFFERED="1", TF_CPP_MIN_LOG_LEVEL="2",
               PATH=f"{bindir}:{os.environ['PATH']}", **thread_env(2, cores=2), **variables)
    return command, env
