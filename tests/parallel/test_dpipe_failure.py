"""A pipeline stage whose neighbour dies or hangs stops with a clear error within 60 s, under both launchers.

Runs tests/parallel/dpipe_workers/neighbour_dies.py (torch) or neighbour_dies_tf.py (Keras) on 2
processes, stage 1 failing after 3 steps, and times from the failing rank's announcement to the end
of the whole job. Both frameworks: a death under horovodrun (Gloo fails the pending broadcasts:
PeerLostError), a death under mpirun (Open MPI aborts the job) and a hang under mpirun (only our own
bounded wait can end it).
"""
from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import time

import pytest

from jobs import two_rank_job

ROOT = pathlib.Path(__file__).resolve().parents[2]
WORKERS = {"torch": ROOT / "tests" / "parallel" / "dpipe_workers" / "neighbour_dies.py",
           "tf": ROOT / "tests" / "parallel" / "dpipe_workers" / "neighbour_dies_tf.py"}


def launch(framework: str, launcher: str, fault: str) -> tuple:
    """Run the framework's worker; return (exit status, output, seconds from the fault to the end)."""
    command, env = two_rank_job(WORKERS[framework], launcher, ROOT, DPIPE_FAULT=fault, DPIPE_TIMEOUT="10")
    process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, start_new_session=True)
    lines, fault_time = [], None
    deadline = time.monotonic() + 240
    try:
        assert process.stdout is not None
        for line in process.stdout:
            lines.append(line)
            if fault_time is None and ("stage 1 dies now" in line or "stage 1 hangs now" in line):
                fault_time = time.monotonic()
            if time.monotonic() > deadline or (fault_time and time.monotonic() - fault_time > 90):
                break
    finally:
        if process.poll() is None:
            time.sleep(1)
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    end = time.monotonic()
    return process.returncode, "".join(lines), (end - fault_time) if fault_time else None


CASES = [("torch", "horovodrun", "die"), ("torch", "mpirun", "die"), ("torch", "mpirun", "hang"),
         ("tf", "horovodrun", "die"), ("tf", "mpirun", "die"), ("tf", "mpirun", "hang")]


@pytest.mark.parametrize("framework, launcher, fault", CASES, ids=["-".join(case) for case in CASES])
def test_stage_stops_with_a_clear_error_within_60_s(framework, launcher, fault):
    status, output, seconds = launch(framework, launcher, fault)
    assert seconds is not None, f"the fault never happened:\n{output[-4000:]}"
    assert status != 0 and "unreachable" not in output, output[-4000:]
    assert seconds < 60, f"the job ran {seconds:.0f} s after stage 1 {fault}d:\n{output[-4000:]}"
    clear = ("PeerLostError" in output or "exited with non-zero status" in output)
    assert clear, f"no clear error after stage 1 {fault}d:\n{output[-4000:]}"
    corrupted = [word for word in ("Segmentation fault", "signal 11", "corrupted", "double free") if word in output]
    assert not corrupted, f"the surviving stage crashed ({corrupted}) after stage 1 {fault}d:\n{output[-4000:]}"
    if fault == "hang":  # nobody died: our own bounded wait must be what stopped it
        assert "PeerLostError after" in output and "nothing arrived within 10 s" in output, output[-4000:]
