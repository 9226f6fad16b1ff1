"""``dualframe doctor`` and ``dualframe run -H`` on the test cluster's host list: the interface, and a host out of reach.

Two hosts are not "this host", so ``dualframe run`` adds no ``--network-interfaces lo``: it asks each
host through the launcher's agent (ssh) and passes the one subnet they share (the cluster's ``eth0``),
which ``dualframe doctor -H`` reports per host. With dfn2 cut off, or a host name that does not
resolve, the launch is refused within seconds naming the host; with the check turned off, Open
MPI's own message (which names no host) is followed by dualframe's naming dfn2.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
import time

import pytest

from _cluster import on_node, require, worker_env

RUN = [sys.executable, "-m", "dualframe", "run", "-np", "2", "-H", "dfn1:1,dfn2:1"]
PROGRAM = ["sh", "-c", 'echo "dualframe-test: rank $HOROVOD_RANK of $HOROVOD_SIZE on $(hostname)"']
#: One message each from both ranks: the sum of (rank + 1) over MPI on the named interface.
ALLREDUCE = [sys.executable, "-c", "import socket; from mpi4py import MPI; c = MPI.COMM_WORLD; "
             "print(f'dualframe-test: rank {c.rank} on {socket.gethostname()} sum {c.allreduce(c.rank + 1)}')"]


@pytest.fixture(scope="module", autouse=True)
def cluster():
    require()


def test_doctor_reports_each_hosts_interfaces_and_the_one_they_share():
    code, output, _ = on_node("dfn1", [sys.executable, "-m", "dualframe", "doctor", "--json", "-H", "dfn1:1,dfn2:1"],
                              worker_env(), 240)
    assert code == 0, output[-6000:]
    hosts = json.loads(output[output.index("{"):])["hosts"]
    for at, host in enumerate(hosts["hosts"], start=1):
        assert host["host"] == f"dfn{at}" and host["reachable"] and host["local"] == (at == 1), host
        assert {"name": "eth0", "address": f"10.203.7.{at}/24"} in host["interfaces"], host
    assert hosts["choice"] == {"interfaces": ["eth0"], "networks": ["10.203.7.0/24"],
                               "reason": "10.203.7.0/24 is the one subnet every host is on (eth0)"}


def test_run_on_two_hosts_passes_the_interface_they_share():
    code, output, _ = on_node("dfn1", RUN + ["--launcher", "horovodrun", *PROGRAM], worker_env(), 180)
    assert code == 0, output[-6000:]
    assert "# --network-interfaces eth0: 10.203.7.0/24 is the one subnet every host is on" in output, output[:2000]
    assert " --gloo --network-interfaces eth0 sh -c " in output, output[:2000]
    assert {"rank 0 of 2 on dfn1", "rank 1 of 2 on dfn2"} <= set(re.findall(r"rank \d of 2 on dfn\d", output)), output


def test_mpirun_on_the_interface_named():
    code, output, _ = on_node("dfn1", RUN + ["--launcher", "mpirun", "--network-interfaces", "eth0", *ALLREDUCE],
                              worker_env(), 180)
    assert code == 0, output[-6000:]
    assert " --mca btl_tcp_if_include eth0 --mca oob_tcp_if_include eth0 " in output, output[:2000]
    assert set(re.findall(r"rank \d on dfn\d sum \d", output)) == {"rank 0 on dfn1 sum 3", "rank 1 on dfn2 sum 3"}, output


def _refused(command: list, limit_s: float) -> str:
    started = time.time()
    code, output, ended = on_node("dfn1", command, worker_env(), 120)
    assert code != 0 and ended - started < limit_s, f"exit {code} after {ended - started:.0f} s:\n{output[-6000:]}"
    return output


def test_a_host_that_cannot_be_reached_is_named_within_seconds():
    subprocess.run(["ip", "-n", "dfn2", "link", "set", "eth0", "down"], check=True)
    try:
        # Asked first (ssh's 5 s connect timeout): refused before anything starts.
        output = _refused(RUN + ["--launcher", "mpirun", *PROGRAM], 15)
        assert re.search(r"dualframe run: cannot reach dfn2 through mpirun's remote agent \(dfn2: ssh: connect to "
                         r"host dfn2 port 22: (Connection timed out|No route to host)\)", output), output
        # Not asked first: Open MPI's message, then dualframe's naming the host.
        output = _refused(RUN + ["--launcher", "mpirun", "--no-host-check", *PROGRAM], 40)
        assert "ORTE was unable to reliably start one or more daemons" in output, output[-6000:]
        assert re.search(r"dualframe run: Open MPI could not start or lost a daemon: cannot reach dfn2 through "
                         r"mpirun's remote agent \(dfn2: ssh: connect to host dfn2", output), output[-6000:]
    finally:
        subprocess.run(["ip", "-n", "dfn2", "link", "set", "eth0", "up"], check=True)
    output = _refused([sys.executable, "-m", "dualframe", "run", "-np", "2", "-H", "dfn1:1,nosuchnode:1",
                       "--launcher", "horovodrun", *PROGRAM], 15)
    assert re.search(r"dualframe run: cannot reach nosuchnode through horovodrun's remote agent \(nosuchnode: "
                     r"ssh: Could not resolve hostname nosuchnode", output), output
