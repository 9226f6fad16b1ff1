"""``dualframe run -H`` on the test cluster's host list: the interface horovodrun chooses, and a host it cannot reach.

Two hosts are not "this host", so ``dualframe run`` adds no ``--network-interfaces lo``; horovodrun
probes the interfaces the nodes share over ssh and must find the cluster's ``eth0``. With dfn2 cut
off, the launch must fail fast with a message naming the host and why.
"""
from __future__ import annotations

import re
import subprocess
import sys

import pytest

from _cluster import on_node, require, worker_env

RUN = [sys.executable, "-m", "dualframe", "run", "-np", "2", "-H", "dfn1:1,dfn2:1", "--launcher", "horovodrun",
       "--launcher-arg=--verbose", "--launcher-arg=--disable-cache"]  # horovodrun caches ssh checks and NICs
PROGRAM = ["sh", "-c", 'echo "dualframe-test: rank $HOROVOD_RANK of $HOROVOD_SIZE on $(hostname)"']


@pytest.fixture(scope="module", autouse=True)
def cluster():
    require()


def test_run_on_two_hosts_uses_the_interface_they_share():
    code, output, _ = on_node("dfn1", RUN + PROGRAM, worker_env(), 180)
    assert code == 0, output[-6000:]
    assert "--network-interfaces" not in output.splitlines()[0], output[:2000]
    assert "Common interface found: eth0" in output, output[-6000:]
    assert {"rank 0 of 2 on dfn1", "rank 1 of 2 on dfn2"} <= set(re.findall(r"rank \d of 2 on dfn\d", output)), output


def test_a_host_that_cannot_be_reached_is_named():
    subprocess.run(["ip", "-n", "dfn2", "link", "set", "eth0", "down"], check=True)
    try:
        code, output, _ = on_node("dfn1", RUN + PROGRAM, worker_env(), 180)
    finally:
        subprocess.run(["ip", "-n", "dfn2", "link", "set", "eth0", "up"], check=True)
    assert code != 0, output[-6000:]
    assert re.search(r"ssh not successful for host dfn2:\s*\nssh: connect to host dfn2 port 22", output), output[-6000:]
