"""Runs every multi-process test file (tests/parallel/mp_*.py) under horovodrun --gloo and under mpirun.

Each worker file is a pytest module that every rank runs in full; this outer test (one process, no
framework loaded) starts it with one launcher call, bounded by a timeout, and checks the exit status.
A worker file may say ``# np: 4``, ``# timeout: 400`` and ``# launchers: horovodrun`` (only that one)
in its first lines.
"""
from __future__ import annotations

import os
import pathlib
import re
import sys

import pytest

from dualframe.launch.commands import find_executable, horovodrun_command, mpirun_command, thread_env
from jobs import run_bounded  # tests/parallel is on sys.path (pytest rootdir import)

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent.parent
WORKERS = sorted(HERE.glob("mp_*.py"))
LAUNCHERS = ("horovodrun", "mpirun")


def _header(path: pathlib.Path, key: str, default: int) -> int:
    match = re.search(rf"^# {key}: (\d+)$", path.read_text()[:2000], re.MULTILINE)
    return int(match.group(1)) if match else default


def _launchers(path: pathlib.Path) -> tuple:
    match = re.search(r"^# launchers: ([\w ,]+)$", path.read_text()[:2000], re.MULTILINE)
    return tuple(match.group(1).replace(",", " ").split()) if match else LAUNCHERS


CASES = [(w, launcher) for w in WORKERS for launcher in _launchers(w)]


def _command(launcher: str, np: int, program: list) -> list:
    bindir = pathlib.Path(sys.executable).parent
    if launcher == "horovodrun":
        return horovodrun_command(np, program, horovodrun=str(bindir / "horovodrun"))
    return mpirun_command(np, program, oversubscribe=True,
                          export=("PATH", "PYTHONPATH", "PYTHONUNBUFFERED", "DUALFRAME_TEST_LAUNCHER",
                                  "TF_CPP_MIN_LOG_LEVEL", *thread_env(1)))


@pytest.mark.parametrize("worker, launcher", CASES, ids=[f"{w.stem}-{launcher}" for w, launcher in CASES])
def test_worker_file(worker: pathlib.Path, launcher: str) -> None:
    if find_executable(launcher, {"PATH": f"{pathlib.Path(sys.executable).parent}:{os.environ['PATH']}"}) is None:
        pytest.fail(f"{launcher} is not installed: run `bash scripts/bootstrap.sh`")
    np = _header(worker, "np", 2)
    timeout = _header(worker, "timeout", 300)
    program = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider",
               f"--timeout={timeout}", "--rootdir", str(ROOT), str(worker)]
    env = dict(os.environ, PYTHONUNBUFFERED="1", DUALFRAME_TEST_LAUNCHER=launcher, TF_CPP_MIN_LOG_LEVEL="2",
               PATH=f"{pathlib.Path(sys.executable).parent}:{os.environ['PATH']}",
               PYTHONPATH=str(ROOT), **thread_env(np, cores=np))
    code, output = run_bounded(_command(launcher, np, program), env, ROOT, timeout + 60,
                               f"{launcher} -np {np} {worker.name}")
    assert code == 0, f"{launcher} -np {np} {worker.name} exited {code}:\n{output[-8000:]}"
    assert re.search(r"\d+ passed", output), f"no test passed in {worker.name}:\n{output[-4000:]}"
