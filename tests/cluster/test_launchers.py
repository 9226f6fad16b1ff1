"""tests/cluster/mp_cluster_torch.py on 2 nodes of the test cluster, under mpirun -H, horovodrun -H and srun.

One launcher call per case, started on node dfn1 (as from a cluster's first node): 4 ranks, 2 per node,
under mpirun (``--map-by node``: the hybrid's stages across nodes) and srun (block: its replicas across
nodes); 2 ranks,
1 per node, under horovodrun with Gloo and with MPI (the pipeline's stages on different nodes).
"""
from __future__ import annotations

import re
import sys

import pytest

from _cluster import HOROVODRUN, MCA, ROOT, exported, on_node, pytest_program, require, worker_env
from dualframe.launch.commands import horovodrun_command, mpirun_command

WORKER = ROOT / "tests" / "cluster" / "mp_cluster_torch.py"
TIMEOUT = 240


@pytest.fixture(scope="module", autouse=True)
def cluster():
    require()


def command(case: str, env: dict) -> list:
    program = pytest_program(WORKER, TIMEOUT)
    if case == "mpirun":
        # --map-by node: ranks 0, 2 on dfn1 (stage 0 of both replicas), ranks 1, 3 on dfn2 (stage 1).
        line = mpirun_command(4, program, hosts="dfn1:2,dfn2:2", export=(), as_root=True)
        at = line.index("--bind-to")
        line[line.index("--map-by") + 1] = "node"
        return line[:at] + MCA + exported(env) + line[at:]
    if case == "srun":
        # Block: ranks 0, 1 on dfn1 (replica 0), ranks 2, 3 on dfn2 (replica 1).
        return ["srun", "--mpi=pmix", "--nodes=2", "--ntasks=4", "--ntasks-per-node=2", "--kill-on-bad-exit=1", *program]
    gloo = case == "horovodrun-gloo"
    return horovodrun_command(2, program, hosts="dfn1:1,dfn2:1", gloo=gloo, horovodrun=HOROVODRUN)


#: Each case's hybrid layout, and the tests that pass on every rank: topology and data parallelism,
#: then the hybrid (gpipe, 1f1b) on 4 ranks or the pipeline (gpipe, 1f1b per transport) on 2.
CASES = {"mpirun": ("stages", 4), "srun": ("replicas", 4), "horovodrun-gloo": ("", 4), "horovodrun-mpi": ("", 6)}


@pytest.mark.parametrize("case", list(CASES))
def test_strategies_across_nodes_equal_one_process(case):
    env = worker_env(DUALFRAME_TEST_LAUNCHER=case.split("-")[0], DUALFRAME_TEST_NODES="2",
                     DUALFRAME_TEST_LAYOUT=CASES[case][0])
    code, output, _ = on_node("dfn1", command(case, env), env, TIMEOUT + 60)
    assert code == 0, f"{case} exited {code}:\n{output[-8000:]}"
    ranks = 4 if CASES[case][0] else 2
    passed = re.findall(r"(\d+) passed", output)
    assert passed == [str(CASES[case][1])] * ranks, f"{case}: per-rank passes {passed}:\n{output[-4000:]}"


@pytest.mark.parametrize("first", ["last", "first"])
def test_pipeline_script_ends_cleanly_under_srun(first):
    """tests/parallel/dpipe_workers/exit_unbalanced.py, one stage per node: both ranks exit 0 whichever leaves first."""
    worker = ROOT / "tests" / "parallel" / "dpipe_workers" / "exit_unbalanced.py"
    env = worker_env(DPIPE_FIRST=first)
    line = ["srun", "--mpi=pmix", "--nodes=2", "--ntasks=2", "--ntasks-per-node=1", "--kill-on-bad-exit=1",
            sys.executable, str(worker)]
    code, output, _ = on_node("dfn1", line, env, TIMEOUT)
    assert code == 0 and "signal 11" not in output and "Segmentation" not in output, f"exit {code}:\n{output[-6000:]}"
    assert sorted(re.findall(r"rank (\d): balance \[\d+, \d+\]: 3 losses equal one process", output)) == \
        ["0", "0", "1", "1"], output[-6000:]
    light = "1" if first == "last" else "0"
    assert re.search(rf"rank {light}: leaving first", output), output[-6000:]
