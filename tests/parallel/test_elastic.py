"""Elastic data parallelism under ``horovodrun --min-np 1 --max-np 2`` on this machine: workers leave and join.

The machine is named twice in the discovery scripts (``localhost:1`` and ``127.0.0.1:1``): Horovod
blacklists the host of a failed worker, and a joining worker needs a slot of its own. ``dualframe
run`` adds ``--network-interfaces lo`` (without it elastic horovodrun hangs here). The workers in
tests/parallel/failure_workers/ check their weights against a one-process reference themselves.
"""
from __future__ import annotations

import os
import pathlib
import re
import sys

import pytest

from dualframe.launch.run import plan_launch
from jobs import run_bounded  # tests/parallel is on sys.path (pytest rootdir import)

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent.parent
WORKERS = HERE / "failure_workers"
TIMEOUT_S = 240


def run_elastic(np: int, program: "list[str]", discovery: pathlib.Path) -> str:
    """Start ``program`` through ``dualframe run``'s launch plan (horovodrun elastic); return its output if it succeeded."""
    job = plan_launch(np, program, launcher="horovodrun", threads=1, launcher_args=[
        "--min-np", "1", "--max-np", "2", "--host-discovery-script", str(discovery)])
    assert job.command[job.command.index("--network-interfaces") + 1] == "lo", job.command
    bindir = pathlib.Path(sys.executable).parent
    # A worker stuck in a collective ends the job after 90 s instead of waiting for the timeout.
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1", TF_CPP_MIN_LOG_LEVEL="2",
               DUALFRAME_STALL_TIMEOUT="90", PATH=f"{bindir}:{os.environ['PATH']}", **job.env)
    code, output = run_bounded(job.command, env, ROOT, TIMEOUT_S, "elastic horovodrun")
    assert code == 0, f"the elastic job failed:\n{output[-6000:]}"
    return output


def discovery_script(folder: pathlib.Path, second_after: "pathlib.Path | None" = None) -> pathlib.Path:
    """A host discovery script: ``localhost:1``, and ``127.0.0.1:1`` (once ``second_after`` exists, if given)."""
    script = folder / "discover_hosts.sh"
    second = (f"if [ -e {second_after} ]; then echo 127.0.0.1:1; fi" if second_after
              else "echo 127.0.0.1:1")
    script.write_text(f"#!/bin/sh\necho localhost:1\n{second}\n")
    script.chmod(0o755)
    return script


@pytest.mark.parametrize("script, finished, extra", [
    ("torch_elastic.py", r"elastic run finished 12 steps on 1 worker\(s\), equal to the reference", []),
    ("torch_elastic.py", r"elastic run finished 12 steps on 1 worker\(s\), equal to the reference",
     ["--shard", "optimizer"]),
    ("keras_elastic.py", r"elastic run finished 2 epochs on 1 worker\(s\), equal to the reference", []),
], ids=["torch", "torch-sharded", "keras"])
def test_elastic_worker_killed_mid_epoch_survivor_finishes_from_the_last_commit(
        script: str, finished: str, extra: "list[str]", tmp_path: pathlib.Path) -> None:
    """With a sharded optimizer the lost worker's slices come back from the last commit (gathered in full)."""
    output = run_elastic(2, [str(WORKERS / script), *extra], discovery_script(tmp_path))
    assert "dualframe-test: fault kill at" in output, f"the worker was never killed:\n{output[-6000:]}"
    assert "reset, now 1 worker(s)" in output, output[-6000:]
    assert re.search(finished, output), output[-6000:]


@pytest.mark.parametrize("script, finished, extra", [
    ("torch_elastic.py", r"grown run finished 12 steps on 2 workers, rank {rank} equal to the reference", []),
    ("torch_elastic.py", r"grown run finished 12 steps on 2 workers, rank {rank} equal to the reference",
     ["--shard", "gradients"]),
    ("keras_elastic.py", r"grown run finished 2 epochs on 2 workers, rank {rank} equal to the reference", []),
], ids=["torch", "torch-sharded", "keras"])
def test_elastic_job_grows_from_one_worker_to_two_and_matches_one_process(
        script: str, finished: str, extra: "list[str]", tmp_path: pathlib.Path) -> None:
    """One slot until the first worker has committed (it writes the marker), then two; the job finishes on two.

    The global batch per step is fixed and split over the current workers, so both workers must end
    equal to a one-process reference on the whole batches (and to each other): that fails if the
    optimizer kept the 1-worker decision (no allreduce) after the reset.
    """
    marker = tmp_path / "first-worker-committed"
    output = run_elastic(1, [str(WORKERS / script), "--grow", str(marker), *extra], discovery_script(tmp_path, marker))
    assert marker.exists(), output[-6000:]
    assert "reset, now 2 worker(s)" in output, f"the job never grew:\n{output[-6000:]}"
    for rank in (0, 1):
        assert re.search(finished.format(rank=rank), output), f"rank {rank} did not finish:\n{output[-6000:]}"
