"""A 2-process pipeline script that simply ends exits 0 on both ranks, whichever stage finishes first.

Runs tests/parallel/dpipe_workers/exit_unbalanced.py (torch) or exit_unbalanced_tf.py (Keras) under
mpirun and horovodrun: two pipelines in one process (the first dropped after training, the second open at
exit), each step's loss equal to one process's, and no barrier or collective at the end. With the last
stage light (``last``), its rank leaves while the first stage still computes its last step; under mpirun
that rank's Horovod shutdown used to stop Horovod on the other rank, which finalized the MPI its pipeline
was still receiving on (SIGSEGV, exit 139). With the first stage light (``first``), rank 0 leaves first.
"""
from __future__ import annotations

import pathlib
import re

import pytest

from jobs import run_bounded, two_rank_job

ROOT = pathlib.Path(__file__).resolve().parents[2]
WORKERS = {"torch": ROOT / "tests" / "parallel" / "dpipe_workers" / "exit_unbalanced.py",
           "tf": ROOT / "tests" / "parallel" / "dpipe_workers" / "exit_unbalanced_tf.py"}
#: What a crash at exit prints, from the launcher or glibc.
CRASHES = ("Segmentation fault", "signal 11", "corrupted", "double free", "Aborted", "Traceback")


def launch(framework: str, launcher: str, first: str) -> tuple:
    """Run the framework's worker with DPIPE_FIRST=``first``; return (exit status, output)."""
    command, env = two_rank_job(WORKERS[framework], launcher, ROOT, DPIPE_FIRST=first)
    return run_bounded(command, env, ROOT, 240, f"{framework} pipelines under {launcher}, {first} stage first")


CASES = [("torch", "mpirun", "last"), ("torch", "mpirun", "first"), ("torch", "horovodrun", "last"),
         ("torch", "horovodrun", "first"), ("tf", "mpirun", "last"), ("tf", "mpirun", "first"),
         ("tf", "horovodrun", "last")]


@pytest.mark.parametrize("framework, launcher, first", CASES, ids=["-".join(case) for case in CASES])
def test_pipeline_script_ends_cleanly_whichever_stage_finishes_first(framework, launcher, first):
    status, output = launch(framework, launcher, first)
    crashed = [word for word in CRASHES if word in output]
    assert status == 0 and not crashed, f"exit {status}, {crashed or 'no crash printed'}:\n{output[-6000:]}"
    trained = re.findall(r"rank (\d): balance \[\d+, \d+\]: 3 losses equal one process", output)
    assert sorted(trained) == ["0", "0", "1", "1"], f"each rank trains both pipelines:\n{output[-6000:]}"
    light = "1" if first == "last" else "0"
    assert re.search(rf"rank {light}: leaving first", output), output[-6000:]
    assert re.search(rf"rank {1 - int(light)}: leaving after the other rank", output), output[-6000:]
