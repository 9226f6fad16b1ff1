"""The test cluster of scripts/cluster.sh as the tests see it: whether it is up, and running on a node.

A suite that needs the cluster calls ``require()``: without root or without the cluster it is skipped
with the reason, except where ``DUALFRAME_CLUSTER_REQUIRED=1`` (scripts/test.sh sets it as root,
after bringing the cluster up), where it fails instead.
"""
from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys
import time
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import pytest

from dualframe.launch.commands import thread_env
from tests.parallel.jobs import run_bounded  # the repository root is on sys.path (PYTHONPATH, or python -m pytest)

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "cluster.sh"
#: Shared by every node (only /tmp is per node), removed by `cluster.sh down`.
SHARED = pathlib.Path("/run/dualframe-cluster/work")
SUBNET = os.environ.get("DUALFRAME_CLUSTER_NET", "10.203.7") + ".0/24"
#: Open MPI's TCP traffic and its out-of-band channel on the cluster's network only.
MCA = ["--mca", "btl_tcp_if_include", SUBNET, "--mca", "oob_tcp_if_include", SUBNET]
BINDIR = pathlib.Path(sys.executable).parent
HOROVODRUN = str(BINDIR / "horovodrun")


def unavailable() -> Optional[str]:
    """Why the cluster cannot be used here, or None when it is up."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "the test cluster needs root (network namespaces): sudo bash scripts/cluster.sh up, then run as root"
    result = subprocess.run(["bash", str(SCRIPT), "status"], capture_output=True, text=True, timeout=60)
    if result.returncode != 0:
        return f"the test cluster is not up (bash scripts/cluster.sh up):\n{result.stdout}{result.stderr}"
    return None


def require() -> None:
    """Skip (or fail, where the cluster is required) when the cluster is not there."""
    reason = unavailable()
    if reason is None:
        return
    if os.environ.get("DUALFRAME_CLUSTER_REQUIRED") == "1":
        pytest.fail(reason)
    pytest.skip(reason)


def worker_env(**extra: str) -> Dict[str, str]:
    """What every rank needs: this worktree's dualframe, the venv first on PATH, one thread each."""
    return dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1", TF_CPP_MIN_LOG_LEVEL="2",
                PATH=f"{BINDIR}:{os.environ['PATH']}", **thread_env(1, cores=1), **extra)


def exported(env: Mapping[str, str]) -> List[str]:
    """mpirun ``-x`` for the variables ranks on other nodes need (ssh starts them with a bare environment)."""
    names = ["PATH", "PYTHONPATH", "PYTHONUNBUFFERED", "TF_CPP_MIN_LOG_LEVEL", *thread_env(1)]
    names += sorted(name for name in env if name.startswith("DUALFRAME_"))
    return [arg for name in names if name in env for arg in ("-x", name)]


def on_node(node: str, command: Sequence[str], env: Mapping[str, str], timeout: float) -> Tuple[int, str, float]:
    """Run ``command`` on ``node`` (scripts/cluster.sh exec); return (exit status, output, end time)."""
    code, output = run_bounded(["bash", str(SCRIPT), "exec", node, *command], env, ROOT, timeout,
                               f"{' '.join(command[:8])} ... on {node}")
    return code, output, time.time()


def pytest_program(worker: pathlib.Path, timeout: int) -> List[str]:
    """The worker file under pytest, as every rank runs it."""
    return [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", f"--timeout={timeout}",
            "--rootdir", str(ROOT), str(worker)]


#: The survivor's lines (rank 0 of 2, on dfn1), and what its last one must say after rank 1 on dfn2 was lost.
SURVIVOR = re.compile(r"dualframe: rank 0/2 \(pid \d+ on dfn1\) (.*)")
LOST = re.compile(r"lost rank 1 \(host dfn2, pid \d+\)")


def survivor_names_the_lost_rank(output: str) -> Tuple[bool, str]:
    """(whether the survivor's last dualframe line names rank 1 on dfn2, that line)."""
    said = SURVIVOR.findall(output)
    return bool(said and LOST.search(said[-1])), (said[-1] if said else "(no dualframe line from rank 0)")


def wait_slurm_idle(timeout: float = 90) -> None:
    """Wait until every Slurm node is idle again (a node cut off comes back when its slurmd answers)."""
    deadline, states = time.time() + timeout, ""
    while time.time() < deadline:
        code, states, _ = on_node("dfn1", ["sinfo", "-h", "-N", "-o", "%N %t"], os.environ, 30)
        lines = states.split()
        if code == 0 and lines and all(state == "idle" for state in lines[1::2]):
            return
        for node, state in zip(lines[::2], lines[1::2]):
            if state.startswith("down"):  # back on the network: the administrator's resume, not a wait
                on_node("dfn1", ["scontrol", "update", f"NodeName={node}", "State=RESUME"], os.environ, 30)
        time.sleep(2)
    pytest.fail(f"Slurm nodes not idle after {timeout:.0f} s:\n{states}")
