"""Exact resume of process pipelines: 10 steps straight == 5 steps, the job killed (SIGKILL of stage 1), 5 resumed.

Each case starts a worker from tests/parallel/dpipe_workers/ twice with one launcher on 2 processes
(2 stages): ``--phase crash`` (straight run, then a run saving every stage each step until stage
1's rank is SIGKILLed after the checkpoint of step 5: the job must end non-zero within 60 s) and
``--phase resume`` (load the stages' parts, finish, compare losses and weights with the straight
run and the merged full-model checkpoint with it and with one process). The launch and resume
helpers are tests/parallel/test_failures.py's.
"""
from __future__ import annotations

import pathlib
import re
import sys

import pytest

from test_failures import KILLED, LIMIT_S, launch, resume  # tests/parallel is on sys.path (pytest rootdir import)

WORKERS = pathlib.Path(__file__).resolve().parent / "dpipe_workers"

#: torch under both launchers; Keras (a TF process costs 5-10 s to start) under mpirun only.
CASES = [("torch_resume.py", "horovodrun"), ("torch_resume.py", "mpirun"), ("keras_resume.py", "mpirun")]


@pytest.mark.parametrize("script, launcher", CASES, ids=[f"{s.split('_')[0]}-{l}" for s, l in CASES])
def test_pipeline_exact_resume_after_a_stage_is_killed(script: str, launcher: str, tmp_path: pathlib.Path) -> None:
    worker = str(WORKERS / script)
    code, output, elapsed = launch(launcher, [sys.executable, worker, "--phase", "crash", "--dir", str(tmp_path)])
    assert code != 0 and re.search(KILLED[launcher], output), f"{launcher}: stage 1 was not killed:\n{output[-6000:]}"
    assert elapsed < LIMIT_S, f"{launcher}: the job took {elapsed:.1f}s after the kill (limit {LIMIT_S}s)"
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["stage-0", "stage-1"], list(tmp_path.iterdir())
    resume(launcher, worker, tmp_path)
