"""dualframe.pipeline.mpi_direct in one process: why a rank lacks MPI point-to-point, the bounded poll, the handles."""
from dualframe.pipeline.mpi_direct import MPIDirect, missing, poll


def test_missing_names_the_reason_before_touching_mpi():
    assert missing("cuda:0", True, 0, 2, 8).startswith("the stage is on cuda:0")
    assert missing("", False, 0, 2, 8) == "Horovod runs on Gloo, not MPI (horovodrun --gloo)"


def test_poll_is_bounded():
    calls = []
    assert poll(lambda: calls.append(1) or len(calls) == 3, timeout=1.0) and len(calls) == 3
    assert poll(lambda: False, timeout=0.02) is False


class Request:
    def __init__(self):
        self.finished = False

    def Test(self):  # noqa: N802 (mpi4py's name)
        return self.finished


class Comm:
    """Records what MPIDirect asks of a communicator (the real one is tested under mpirun)."""

    def __init__(self):
        self.calls = []

    def Isend(self, data, dest, tag):  # noqa: N802
        self.calls.append(("send", data, dest, tag))
        return Request()

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
    received[0].finished = True
    assert direct.done(received, timeout=0.01) and direct.result(received) == "tensor y"
    assert direct.result(sent) == "x" and direct.stopped(RuntimeError()) is None
