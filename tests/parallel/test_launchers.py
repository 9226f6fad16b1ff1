"""Runs every multi-process test file (tests/parallel/mp_*.py) under horovodrun --gloo and under mpirun.

Each worker file is a pytest module that every rank runs in full; this outer test (one process, no
framework loaded) starts it with one launcher call, bounded by a timeout, and checks the exit status.
A worker file may say ``# np: 4``, ``# timeout: 400`` and ``# launchers: horovodrun`` (only that one)
in its first lines. The files of one feature listed together in ``SHARED_LAUNCHES`` run one after the
other in one pytest run per launcher: each launch costs seconds (a TensorFlow process 5-10 s to start),
and every file still runs under both launchers. ``DUALFRAME_TEST_FILES_APART=1`` launches each file
alone (``-k vstages`` then picks one file's launches, not its group's).
"""
from __future__ import annotations

import os
import pathlib
import re
import sys
from typing import List, Tuple

import pytest

from dualframe.launch.commands import find_executable, horovodrun_command, mpirun_command, thread_env
from jobs import run_bounded  # tests/parallel is on sys.path (pytest rootdir import)

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent.parent
WORKERS = sorted(HERE.glob("mp_*.py"))
LAUNCHERS = ("horovodrun", "mpirun")

#: Worker files that share a launch, in the order they run. Horovod starts once per process, with the
#: first file's ``hvd.init()`` (at import in Keras files, so at collection); a later file's
#: ``hvd.init(process_sets=...)`` registers the sets Horovod does not run yet (Horovod restarts with
#: them: ``HorovodCollectives.join_process_sets``; mp_torch_zero3.py after mp_torch_shard.py runs
#: that path). A file that checks the calls refused before init comes first; two such files, and a
#: file that sets a global Keras dtype policy at import (mp_tf_keras_hub.py), launch apart.
SHARED_LAUNCHES = (
    ("mp_torch_dp.py", "mp_torch_collectives.py", "mp_torch_split.py", "mp_torch_failure.py"),
    ("mp_torch_shard.py", "mp_torch_zero3.py", "mp_torch_shard_amp.py"),
    ("mp_torch_dpipe_forged.py", "mp_torch_dpipe.py", "mp_torch_vstages.py", "mp_torch_tied.py",
     "mp_torch_hf.py"),
    ("mp_torch_dpipe_hybrid.py", "mp_torch_graph_pipeline_hybrid.py", "mp_torch_vstages_hybrid.py"),
    ("mp_tf_shard.py", "mp_tf_shard_amp.py", "mp_tf_dp.py", "mp_tf_horovod_api.py", "mp_tf_collectives.py"),
    ("mp_tf_dpipe.py", "mp_tf_vstages.py", "mp_tf_dpipe_graph.py", "mp_tf_tied.py"),
    ("mp_tf_dpipe_fit.py", "mp_tf_dpipe_hybrid.py", "mp_tf_graph_pipeline_hybrid.py", "mp_tf_vstages_hybrid.py",
     "mp_tf_shard_sets.py"),
)


def _header(path: pathlib.Path, key: str, default: int) -> int:
    match = re.search(rf"^# {key}: (\d+)$", path.read_text()[:2000], re.MULTILINE)
    return int(match.group(1)) if match else default


def _launchers(path: pathlib.Path) -> tuple:
    match = re.search(r"^# launchers: ([\w ,]+)$", path.read_text()[:2000], re.MULTILINE)
    return tuple(match.group(1).replace(",", " ").split()) if match else LAUNCHERS


def _launches() -> List[Tuple[pathlib.Path, ...]]:
    """Every worker file once: the shared launches (files that exist), then each other file alone."""
    if os.environ.get("DUALFRAME_TEST_FILES_APART") == "1":
        return [(w,) for w in WORKERS]
    present = {w.name: w for w in WORKERS}
    launches = [tuple(present[name] for name in group if name in present) for group in SHARED_LAUNCHES]
    launches = [files for files in launches if files]
    shared = {w for files in launches for w in files}
    for files in launches:
        headers = {(_header(w, "np", 2), _launchers(w)) for w in files}
        if len(headers) > 1:
            raise ValueError(f"files sharing a launch must say the same np and launchers "
                             f"({', '.join(w.name for w in files)}: {sorted(headers)})")
    return launches + [(w,) for w in WORKERS if w not in shared]


CASES = [(files, launcher) for files in _launches() for launcher in _launchers(files[0])]


def _command(launcher: str, np: int, program: list) -> list:
    bindir = pathlib.Path(sys.executable).parent
    if launcher == "horovodrun":
        return horovodrun_command(np, program, horovodrun=str(bindir / "horovodrun"))
    return mpirun_command(np, program, oversubscribe=True,
                          export=("PATH", "PYTHONPATH", "PYTHONUNBUFFERED", "DUALFRAME_TEST_LAUNCHER",
                                  "TF_CPP_MIN_LOG_LEVEL", *thread_env(1)))


def _name(files: tuple) -> str:
    """Each file's name without ``mp_``, framework included: ``-k torch_dpipe_hybrid`` picks the torch launch only."""
    return "+".join(w.stem[len("mp_"):] for w in files)


@pytest.mark.parametrize("files, launcher", CASES, ids=[f"{_name(files)}-{launcher}" for files, launcher in CASES])
def test_worker_file(files: tuple, launcher: str) -> None:
    if find_executable(launcher, {"PATH": f"{pathlib.Path(sys.executable).parent}:{os.environ['PATH']}"}) is None:
        pytest.fail(f"{launcher} is not installed: run `bash scripts/bootstrap.sh`")
    np = _header(files[0], "np", 2)
    timeouts = [_header(w, "timeout", 300) for w in files]  # each file's bound, per test and in all
    program = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider",
               f"--timeout={max(timeouts)}", "--rootdir", str(ROOT), *map(str, files)]
    env = dict(os.environ, PYTHONUNBUFFERED="1", DUALFRAME_TEST_LAUNCHER=launcher, TF_CPP_MIN_LOG_LEVEL="2",
               PATH=f"{pathlib.Path(sys.executable).parent}:{os.environ['PATH']}",
               PYTHONPATH=str(ROOT), **thread_env(np, cores=np))
    what = f"{launcher} -np {np} {' '.join(w.name for w in files)}"
    code, output = run_bounded(_command(launcher, np, program), env, ROOT, sum(timeouts) + 60, what)
    assert code == 0, f"{what} exited {code}:\n{output[-8000:]}"
    passed = re.findall(r"(\d+) passed", output)  # each rank's count (pytest may colour it under mpirun)
    assert passed, f"no test passed in {what}:\n{output[-4000:]}"
    print(f"{what}: {' '.join(passed)} passed")  # pytest -rP shows each launch's counts
