"""dualframe.pipeline.mpi_direct in one process: why a rank lacks MPI point-to-point, the bounded poll, the handles,
and the requests cancelled or kept when a transport closes."""
import gc
import json
import os
import pathlib
import subprocess
import sys
import textwrap
import time

import pytest

from dualframe.pipeline import mpi_direct
from dualframe.pipeline.mpi_direct import MAX_PAUSE_S, MPIDirect, missing, pause_after, poll

ROOT = pathlib.Path(__file__).resolve().parents[3]


def test_missing_names_the_reason_before_touching_mpi():
    assert missing("cuda:0", True, 0, 2, 8).startswith("the stage is on cuda:0")
    assert missing("", False, 0, 2, 8) == "Horovod runs on Gloo, not MPI (horovodrun --gloo)"


def test_poll_is_bounded():
    calls = []
    assert poll(lambda: calls.append(1) or len(calls) == 3, timeout=1.0) and len(calls) == 3
    assert poll(lambda: False, timeout=0.02) is False


def test_a_long_wait_backs_off_to_a_pause_of_a_millisecond():
    assert [pause_after(w) for w in (0.0, 0.004, 0.02, 10.0)] == [0.0, 0.0002, MAX_PAUSE_S, MAX_PAUSE_S]
    calls, start = [], time.monotonic()
    assert poll(lambda: calls.append(1) or time.monotonic() - start > 0.2, timeout=5.0)
    # The old 0.2 ms pauses tested ~700 times in 0.2 s; a pause growing to 1 ms tests ~260 times.
    assert len(calls) < 400, f"{len(calls)} tests in a 0.2 s wait: the wait does not back off"


def test_a_wait_ends_soon_after_the_message_lands():
    start = time.monotonic()
    assert poll(lambda: time.monotonic() - start > 0.05, timeout=5.0)
    late = time.monotonic() - start - 0.05
    assert late < pause_after(0.05) + 0.02, f"the wait ended {late * 1000:.1f} ms after the message landed"


_SELF_WAIT = textwrap.dedent("""
    import json, threading, time
    import numpy as np
    from mpi4py import MPI
    from dualframe.pipeline.mpi_direct import MPIDirect

    direct = MPIDirect(MPI.COMM_SELF.Dup(), outgoing=lambda a: a, incoming=lambda b: (b, lambda: b))
    handle = direct.receive(np.zeros(4, dtype=np.float32), source=0, tag=3)
    timer = threading.Timer(0.3, lambda: direct.send(np.arange(4, dtype=np.float32), dest=0, tag=3))
    start, cpu = time.monotonic(), time.thread_time()
    timer.start()
    arrived = direct.done(handle, timeout=5.0)
    wall, cpu = time.monotonic() - start, time.thread_time() - cpu
    timer.join()
    print(json.dumps({"arrived": arrived, "value": direct.result(handle).tolist(), "wall": wall, "cpu": cpu}))
    direct.close()
""")


def test_a_real_mpi_receive_waits_without_holding_a_core():
    pytest.importorskip("mpi4py")
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-c", _SELF_WAIT], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    waited = json.loads(done.stdout.strip().splitlines()[-1])
    assert waited["arrived"] and waited["value"] == [0.0, 1.0, 2.0, 3.0]
    assert 0.3 <= waited["wall"] < 0.3 + 0.1, waited
    # A spinning wait keeps its thread on a core the whole 0.3 s; this one sleeps between tests.
    assert waited["cpu"] < 0.2 * waited["wall"], f"the waiting thread used {waited['cpu']:.3f} s of {waited['wall']:.3f} s"


class Request:
    def __init__(self, cancellable=True):
        self.finished, self.cancelled, self.cancellable = False, False, cancellable

    def Test(self):  # noqa: N802 (mpi4py's name)
        return self.finished

    def Cancel(self):  # noqa: N802
        self.cancelled = True
        self.finished = self.cancellable  # a receive ends cancelled; a send to nobody does not


class Comm:
    """Records what MPIDirect asks of a communicator (the real one is tested under mpirun)."""

    def __init__(self):
        self.calls = []

    def Isend(self, data, dest, tag):  # noqa: N802
        self.calls.append(("send", data, dest, tag))
        return Request(cancellable=False)

    def Irecv(self, data, source, tag):  # noqa: N802
        self.calls.append(("recv", data, source, tag))
        return Request()


def test_handles_carry_the_buffers_and_read_back_the_received_tensor():
    comm = Comm()
    direct = MPIDirect(comm, outgoing=lambda t: f"bytes of {t}", incoming=lambda b: (f"buffer {b}", lambda: f"tensor {b}"))
    sent = direct.send("x", dest=1, tag=6)
    received = direct.receive("y", source=0, tag=7)
    assert comm.calls == [("send", "bytes of x", 1, 6), ("recv", "buffer y", 0, 7)]
    assert direct.done(received, timeout=0.01) is False
    received.request.finished = True
    assert direct.done(received, timeout=0.01) and direct.result(received) == "tensor y"
    assert direct.result(sent) == "x" and direct.stopped(RuntimeError()) is None


def test_close_cancels_posted_receives_and_keeps_what_mpi_may_still_read():
    direct = MPIDirect(Comm(), outgoing=lambda t: bytearray(4), incoming=lambda b: (bytearray(4), lambda: b))
    done = direct.receive("a", source=0, tag=1)
    done.request.finished = True
    assert direct.done(done, timeout=0.01)  # completed: no longer in flight
    posted, stuck = direct.receive("b", source=0, tag=2), direct.send("c", dest=1, tag=3)
    kept = len(mpi_direct._KEPT)
    direct.in_flight.cancel(timeout=0.01)
    assert posted.request.cancelled and not done.request.cancelled
    assert not stuck.request.cancelled  # sends are never cancelled: the peer may still take them
    assert mpi_direct._KEPT[kept:] == [stuck]  # its buffer lives on with it
    assert direct.in_flight.requests == {}
    del mpi_direct._KEPT[kept:]


def test_a_collected_transport_cancels_its_receives():
    direct = MPIDirect(Comm(), outgoing=lambda t: t, incoming=lambda b: (bytearray(4), lambda: b))
    posted = direct.receive("b", source=0, tag=2)
    del direct
    gc.collect()
    assert posted.request.cancelled
