"""tests/cluster/mp_cluster_keras.py under mpirun -H dfn1:1,dfn2:1: Keras data parallelism across 2 nodes.

One launcher call (a TensorFlow process takes seconds to start); torch's data parallelism runs under
every launcher in test_launchers.py.
"""
from __future__ import annotations

import re

import pytest

from _cluster import MCA, ROOT, exported, on_node, pytest_program, require, worker_env
from dualframe.launch.commands import mpirun_command

WORKER = ROOT / "tests" / "cluster" / "mp_cluster_keras.py"
TIMEOUT = 300


@pytest.fixture(scope="module", autouse=True)
def cluster():
    require()


def test_keras_data_parallel_across_nodes_equals_one_process():
    env = worker_env(DUALFRAME_TEST_LAUNCHER="mpirun")
    line = mpirun_command(2, pytest_program(WORKER, TIMEOUT), hosts="dfn1:1,dfn2:1", export=(), as_root=True)
    at = line.index("--bind-to")
    code, output, _ = on_node("dfn1", line[:at] + MCA + exported(env) + line[at:], env, TIMEOUT + 60)
    assert code == 0, f"mpirun exited {code}:\n{output[-8000:]}"
    assert re.findall(r"(\d+) passed", output) == ["2", "2"], output[-4000:]
