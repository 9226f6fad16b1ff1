"""A checkpointed job across 2 nodes, its rank on dfn2 killed, resumes on the remaining node and ends exact.

tests/parallel/failure_workers/torch_resume.py: ``--phase crash`` trains, checkpoints every step into
the shared folder and SIGKILLs rank 1 (on dfn2) after step 5; mpirun must end the job within 60 s
naming rank 1 and dfn2, and the survivor's last line too. ``--phase resume`` restarts both ranks on dfn1 alone (``-H dfn1:2``) from
the newest checkpoint, and rank 0 checks the weights against 10 straight steps.
"""
from __future__ import annotations

import re
import sys
import time
import uuid

import pytest

from _cluster import MCA, ROOT, SHARED, exported, on_node, require, survivor_names_the_lost_rank, worker_env
from dualframe.launch.commands import mpirun_command

WORKER = ROOT / "tests" / "parallel" / "failure_workers" / "torch_resume.py"
TIMEOUT = 240


@pytest.fixture(scope="module", autouse=True)
def cluster():
    require()


def mpirun(hosts: str, phase: str, folder: str) -> "tuple[int, str, float]":
    env = worker_env()
    line = mpirun_command(2, [sys.executable, str(WORKER), "--phase", phase, "--dir", folder], hosts=hosts,
                          export=(), as_root=True)
    at = line.index("--bind-to")
    return on_node("dfn1", line[:at] + MCA + exported(env) + line[at:], env, TIMEOUT)


def test_killed_on_one_node_resumed_on_the_other_equals_the_straight_run():
    folder = SHARED / f"resume-{uuid.uuid4().hex[:8]}"
    folder.mkdir()
    code, output, ended = mpirun("dfn1:1,dfn2:1", "crash", str(folder))
    fault = re.search(r"dualframe-test: fault kill at ([\d.]+)", output)
    assert code != 0 and fault, f"rank 1 was not killed:\n{output[-6000:]}"
    assert re.search(r"process rank 1 with PID \d+ on node dfn2 exited on signal 9 \(Killed\)", output), output[-6000:]
    named, line = survivor_names_the_lost_rank(output)
    assert named, f"the survivor's last line does not name rank 1 on dfn2 ({line}):\n{output[-6000:]}"
    assert ended - float(fault.group(1)) < 60, f"the job took {ended - float(fault.group(1)):.0f} s after the kill"
    start = time.time()
    code, output, _ = mpirun("dfn1:2", "resume", str(folder))
    assert code == 0, f"the resumed job failed after {time.time() - start:.0f} s:\n{output[-6000:]}"
    assert "resumed run equals the straight run" in output, output[-4000:]
