"""A node lost mid-training ends the job within 60 s, non-zero, with a message naming the lost node or rank.

tests/cluster/fault_worker.py trains on 2 ranks, one per node; once it runs, the test cuts node dfn2
off (its eth0 set down: the cable pulled) or SIGKILLs dfn2's training process (the node's processes
killed), and measures from then to the end of the job. What ends it:

* cut off, mpirun / horovodrun: the launcher's ssh to dfn2 stops answering its keepalives (30 s with
  the cluster's ssh_config) and the launcher ends the job; Horovod's stall check names the missing
  rank first (``HOROVOD_STALL_CHECK_TIME_SECONDS=5``). mpirun is started by ``dualframe run``, which
  follows Open MPI's message (it names no node) with one naming dfn2, which no longer answers ssh. dualframe's stall timeout is set above the ssh
  keepalive on purpose: a survivor that ends itself first makes mpirun wait on the lost node's daemon
  (Open MPI 4.1 then hangs in its abort).
* cut off, srun: slurmctld marks dfn2 down (``SlurmdTimeout=20`` in the test cluster) and ends the
  step, naming the node; dualframe's stall timeout (10 s would end it first, naming only the waiting
  rank) is set above that here.
* killed: the launcher sees its child die on dfn2 and names rank 1 (and the node).

Whichever rank exits first, the survivor's (rank 0 on dfn1) last ``dualframe:`` line names the lost
rank with its host and pid (``lost rank 1 (host dfn2, pid N): ...``): the heartbeat's notice after
``DUALFRAME_PEER_TIMEOUT`` (15 s) of silence, its ``stopped:`` line when Horovod stops, or the line it
writes when the launcher ends it with SIGTERM (docs/reliability.md). Launchers: mpirun (through
``dualframe run``), horovodrun with Gloo and with MPI, srun.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from _cluster import HOROVODRUN, ROOT, require, survivor_names_the_lost_rank, wait_slurm_idle, worker_env
from dualframe.launch.commands import horovodrun_command

WORKER = ROOT / "tests" / "cluster" / "fault_worker.py"
LIMIT_S = 60.0
#: Per (launcher, fault): what the output must say about the lost node or rank.
EXPECTED = {
    # Open MPI 4.1 names neither node nor rank here ("ORTE was unable to reliably start one or more
    # daemons"): dualframe run, which started it, asks the hosts again and names dfn2.
    ("mpirun", "cut"): r"ORTE was unable to reliably start one or more daemons[\s\S]*dualframe run: Open MPI could "
                       r"not start or lost a daemon: cannot reach dfn2 through mpirun's remote agent",
    ("mpirun", "kill"): r"process rank 1 with PID \d+ on node dfn2 exited on signal 9 \(Killed\)",
    # horovodrun names the rank that exited first (either, by a few ms: the survivor's line names rank 1 and dfn2).
    ("horovodrun", "cut"): r"The first process to do so was:\s*Process name: [01]",
    ("horovodrun", "kill"): r"The first process to do so was:\s*Process name: [01]",
    # horovodrun --mpi starts mpirun itself: Open MPI's own words, naming neither rank nor node when cut.
    ("horovodrun-mpi", "cut"): r"ORTE was unable to reliably start one or more daemons",
    ("horovodrun-mpi", "kill"): r"process rank 1 with PID \d+ on node dfn2 exited on signal 9 \(Killed\)",
    ("srun", "cut"): r"srun: error: Node failure on dfn2",
    ("srun", "kill"): r"srun: error: dfn2: task 1: Killed",
}


@pytest.fixture(scope="module", autouse=True)
def cluster():
    require()


def command(launcher: str, env: dict) -> list:
    program = [sys.executable, str(WORKER)]
    if launcher == "mpirun":
        # dualframe run's own -x list lacks the test's DUALFRAME_ variables: through --launcher-arg.
        extra = [f"--launcher-arg={arg}" for name in sorted(env) if name.startswith("DUALFRAME_") for arg in ("-x", name)]
        return [sys.executable, "-m", "dualframe", "run", "--launcher", "mpirun", "-np", "2", "-H", "dfn1:1,dfn2:1",
                "--network-interfaces", "eth0", "--threads", "1", *extra, *program]
    if launcher == "srun":
        return ["srun", "--mpi=pmix", "--nodes=2", "--ntasks=2", "--ntasks-per-node=1", "--kill-on-bad-exit=1",
                *program]
    return horovodrun_command(2, program, hosts="dfn1:1,dfn2:1", gloo=launcher == "horovodrun",
                              horovodrun=HOROVODRUN)


def node_pids(node: str, pattern: str) -> list:
    """Processes in ``node``'s namespace whose command line matches ``pattern``."""
    found = []
    for pid in subprocess.run(["ip", "netns", "pids", node], capture_output=True, text=True).stdout.split():
        try:
            cmdline = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if re.search(pattern, cmdline):
            found.append(int(pid))
    return found


def inject(fault: str) -> None:
    if fault == "cut":
        subprocess.run(["ip", "-n", "dfn2", "link", "set", "eth0", "down"], check=True)
    else:
        for pid in node_pids("dfn2", r"fault_worker\.py"):
            os.kill(pid, signal.SIGKILL)


def heal() -> None:
    """dfn2 back on the network, and nothing of the job left on it (the next case starts clean)."""
    subprocess.run(["ip", "-n", "dfn2", "link", "set", "eth0", "up"], check=True)
    deadline = time.time() + 30
    while time.time() < deadline:
        left = node_pids("dfn2", r"fault_worker\.py|orted|task_fn|sshd: root@")
        if not left:
            break
        time.sleep(1)
    for pid in node_pids("dfn2", r"fault_worker\.py|orted|task_fn|sshd: root@"):
        os.kill(pid, signal.SIGKILL)  # started by this test's job in the test cluster's namespace
    wait_slurm_idle()


#: mpirun's "kill" is the crash phase of test_resume.py (rank 1 on dfn2 SIGKILLed after a checkpoint).
CASES = [("mpirun", "cut"), ("horovodrun", "cut"), ("horovodrun", "kill"), ("horovodrun-mpi", "cut"),
         ("horovodrun-mpi", "kill"), ("srun", "cut"), ("srun", "kill")]


@pytest.mark.parametrize("launcher, fault", CASES, ids=[f"{launcher}-{fault}" for launcher, fault in CASES])
def test_a_lost_node_ends_the_job(launcher, fault):
    stall = "50" if launcher == "srun" else "55"
    env = worker_env(DUALFRAME_STALL_TIMEOUT=stall, HOROVOD_STALL_CHECK_TIME_SECONDS="5")
    process = subprocess.Popen(["bash", str(ROOT / "scripts" / "cluster.sh"), "exec", "dfn1", *command(launcher, env)],
                               cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True)
    lines: list = []
    reader = threading.Thread(target=lambda: lines.extend(iter(process.stdout.readline, "")), daemon=True)
    reader.start()
    fault_at = None
    try:
        deadline = time.time() + 180
        while fault_at is None and time.time() < deadline and process.poll() is None:
            if re.search(r"dualframe-test: step [2-9]\d on 2 ranks", "".join(lines)):
                inject(fault)
                fault_at = time.time()
            time.sleep(0.2)
        process.wait(timeout=LIMIT_S + 30 if fault_at else 1)
    except subprocess.TimeoutExpired:
        pass
    finally:
        ended = time.time()
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        heal()
        reader.join(timeout=10)
    output = "".join(lines)
    if os.environ.get("DUALFRAME_TEST_SHOW"):
        print(output, f"\n{launcher} {fault}: ended {ended - fault_at:.1f} s after the fault" if fault_at else "")
    assert fault_at, f"{launcher}: training never started:\n{output[-6000:]}"
    elapsed = ended - fault_at
    assert process.returncode not in (0, None, -signal.SIGKILL), (
        f"{launcher} {fault}: exit {process.returncode}, {elapsed:.1f} s after the fault:\n{output[-6000:]}")
    assert elapsed < LIMIT_S, f"{launcher} {fault}: the job ended {elapsed:.0f} s after the fault:\n{output[-6000:]}"
    assert re.search(EXPECTED[launcher, fault], output), (
        f"{launcher} {fault}: nothing names the lost node or rank ({EXPECTED[launcher, fault]!r}; "
        f"ended {elapsed:.1f} s after the fault, exit {process.returncode}):\n{output[-6000:]}")
    named, line = survivor_names_the_lost_rank(output)
    assert named, f"{launcher} {fault}: the survivor's last line does not name rank 1 on dfn2 ({line}):\n{output[-6000:]}"
