"""Elastic horovodrun across the test cluster's nodes, with a host discovery script naming dfn1 and dfn2.

The workers are tests/parallel/failure_workers/torch_elastic.py (they check their weights against a
one-process reference themselves). Losing a node: the worker on dfn2 is SIGKILLed mid-epoch,
Horovod drops dfn2 and the survivor on dfn1 finishes from the last commit. Adding one: the discovery
script names dfn2 alone until the first worker has committed, then dfn1 too; the job grows to two
workers on two nodes and both end equal to the reference.
"""
from __future__ import annotations

import pathlib
import re
import uuid

import pytest

from _cluster import HOROVODRUN, ROOT, SHARED, on_node, require, worker_env

WORKER = ROOT / "tests" / "parallel" / "failure_workers" / "torch_elastic.py"
TIMEOUT = 240


@pytest.fixture(scope="module", autouse=True)
def cluster():
    require()


def elastic(np: int, discovery: str, *arguments: str) -> str:
    folder = SHARED / f"elastic-{uuid.uuid4().hex[:8]}"
    folder.mkdir()
    script = folder / "discover_hosts.sh"
    script.write_text(f"#!/bin/sh\n{discovery.format(folder=folder)}\n")
    script.chmod(0o755)
    # The cluster's interface named: with a discovery script, horovodrun has no host list to probe.
    command = [HOROVODRUN, "-np", str(np), "--min-np", "1", "--max-np", "2", "--host-discovery-script", str(script),
               "--gloo", "--network-interfaces", "eth0", "python", str(WORKER),
               *[a.format(folder=folder) for a in arguments]]
    code, output, _ = on_node("dfn1", command, worker_env(DUALFRAME_STALL_TIMEOUT="90"), TIMEOUT)
    assert code == 0, f"the elastic job failed ({code}):\n{output[-6000:]}"
    return output


def test_a_node_lost_the_survivor_finishes_equal_to_the_reference():
    output = elastic(2, "echo dfn1:1\necho dfn2:1")
    assert "dualframe-test: fault kill at" in output and "reset, now 1 worker(s)" in output, output[-6000:]
    assert re.search(r"elastic run finished 12 steps on 1 worker\(s\), equal to the reference", output), output[-6000:]


def test_a_node_added_the_job_grows_and_matches_one_process():
    # Starts on dfn2 (remote from the driver on dfn1): horovodrun picks its interface when it starts,
    # and a job that starts on the driver's own host alone gets the loopback, which dfn2 cannot reach.
    output = elastic(1, "echo dfn2:1\nif [ -e {folder}/committed ]; then echo dfn1:1; fi", "--grow", "{folder}/committed")
    assert "reset, now 2 worker(s)" in output, f"the job never grew:\n{output[-6000:]}"
    for rank in (0, 1):
        assert re.search(rf"grown run finished 12 steps on 2 workers, rank {rank} equal to the reference", output), output[-6000:]
