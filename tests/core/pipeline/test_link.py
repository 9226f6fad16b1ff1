"""The framework-neutral parts of process pipelines, in one process: headers, bounded waits, the checked layout."""
import pytest

from dualframe.errors import DeviceError, StrategyError
from dualframe.pipeline.link import (TRANSPORT_VARIABLE, agree_transport, check_transport, control_tag, decode_header,
                                  encode_header, largest_tag, message_tag, transport_choice, transport_votes, wait_for)
from dualframe.pipeline.layout import PeerLostError, layout_pipeline


class Stopped(Exception):
    """Stands for a framework's "Horovod shut down" error."""


class OneOpWire:
    """Just the waiting half of a Wire, for one operation that finishes or not, and succeeds or raises."""

    def __init__(self, finishes, outcome):
        self.finishes, self.outcome = finishes, outcome

    def done(self, handle, timeout):
        return self.finishes

    def result(self, handle):
        if isinstance(self.outcome, BaseException):
            raise self.outcome
        return self.outcome

    def stopped(self, error):
        return f"peer gone: {error}" if isinstance(error, Stopped) else None


def test_header_round_trip_and_dimension_limit():
    assert encode_header(((4, 3, 2), 1)) == [3, 4, 3, 2, 0, 0, 0, 0, 0, 1]
    assert decode_header(encode_header(((4, 3, 2), 1))) == ((4, 3, 2), 1)
    assert decode_header(encode_header(((), 0))) == ((), 0)
    with pytest.raises(StrategyError, match=r"at most 8 dimensions \(output shape: \(1, 1, 1, 1, 1, 1, 1, 1, 1\)\)"):
        encode_header(((1,) * 9, 0))


def test_wait_for_returns_the_result_or_raises_peer_lost():
    assert wait_for(OneOpWire(True, 42), None, "waiting for F0", 1.0) == 42
    with pytest.raises(PeerLostError, match=r"^waiting for F0: nothing arrived within 0.5 s; that stage died or hangs"):
        wait_for(OneOpWire(False, 42), None, "waiting for F0", 0.5)
    with pytest.raises(PeerLostError, match=r"^waiting for B1: Horovod stopped \(peer gone: reset\); a neighbouring"):
        wait_for(OneOpWire(True, Stopped("reset")), None, "waiting for B1", 1.0)
    with pytest.raises(KeyError):  # not Horovod stopping: passes through unchanged
        wait_for(OneOpWire(True, KeyError("bug")), None, "waiting for B1", 1.0)
    assert issubclass(PeerLostError, TimeoutError)


def test_layout_checks_every_argument_and_lays_out_the_stages():
    layout = layout_pipeline(5, [3, 2], chunks=3, schedule="1F1B", devices=["cpu", "cpu"], data_parallel=2,
                             world=4)
    assert (layout.schedule, layout.grid.replicas, layout.devices) == ("1f1b", 2, ("cpu", "cpu"))
    assert [[str(a) for a in actions] for actions in layout.actions] == [["F0", "F1", "B0", "F2", "B1", "B2"],
                                                                 ["F0", "B0", "F1", "B1", "F2", "B2"]]
    with pytest.raises(DeviceError, match=r"one device per group \(len\(devices\) = 1, len\(balance\) = 2\)"):
        layout_pipeline(5, [3, 2], chunks=3, devices=["cpu"], world=2)
    with pytest.raises(StrategyError, match=r"timeout must be a number of seconds > 0 \(timeout: 0\)"):
        layout_pipeline(5, [3, 2], chunks=3, timeout=0, world=2)


def test_one_stage_over_several_processes_is_refused_as_data_parallelism():
    with pytest.raises(StrategyError, match=r"one-stage pipeline over several processes is data parallelism "
                                            r"\(balance: \[4\], processes: 2\); use DistributedOptimizer"):
        layout_pipeline(4, [4], chunks=2, world=2)
    assert layout_pipeline(4, [4], chunks=2, world=1).grid.replicas == 1


def test_message_tags_are_distinct_per_micro_batch_and_kind():
    tags = [message_tag(f"{kind}{i}") for i in range(5) for kind in "FB"] + [message_tag(f"F{i}", True) for i in range(5)]
    tags += [control_tag("agree", 5), control_tag("loss", 5)]
    assert len(set(tags)) == len(tags) and max(tags) == largest_tag(5)


def test_transport_choice_reads_and_checks_the_variable():
    assert transport_choice({}) == "auto"
    assert transport_choice({TRANSPORT_VARIABLE: " MPI "}) == "mpi"
    assert transport_choice({TRANSPORT_VARIABLE: "zmq"}) == "zmq"
    with pytest.raises(StrategyError, match=r"must be one of auto, mpi, zmq, horovod \(DUALFRAME_PIPELINE_TRANSPORT: 'nccl'\)"):
        transport_choice({TRANSPORT_VARIABLE: "nccl"})


def test_the_transport_argument_is_checked_and_overrides_the_variable():
    assert [check_transport(t) for t in (None, "auto", " Horovod ", "mpi", "zmq")] == [None, "auto", "horovod", "mpi", "zmq"]
    for bad in ("nccl", "", 1, True):
        with pytest.raises(StrategyError, match=r"transport must be one of auto, mpi, zmq, horovod, or None to read "
                                                r"DUALFRAME_PIPELINE_TRANSPORT \(transport: "):
            check_transport(bad)
    assert transport_choice({TRANSPORT_VARIABLE: "horovod"}, "zmq") == "zmq"  # the argument wins
    assert transport_choice({TRANSPORT_VARIABLE: "horovod"}, "auto") == "auto"  # an explicit auto too
    assert transport_choice({TRANSPORT_VARIABLE: "horovod"}, None) == "horovod"  # None: the variable decides
    assert transport_choice({TRANSPORT_VARIABLE: "nccl"}, "mpi") == "mpi"  # a bad variable the argument overrides is not read
    with pytest.raises(StrategyError, match=r"transport must be one of"):
        transport_choice({}, "gloo")


def test_refusals_name_the_argument_when_it_asked():
    with pytest.raises(StrategyError, match=r"^transport=mpi needs mpi point-to-point on every rank \(2 of 2 lack it; "
                                            r"here: Horovod runs on Gloo\)"):
        agree_transport(sums(("mpi", GLOO), ("mpi", GLOO)), 2, "mpi", GLOO, "transport")
    with pytest.raises(StrategyError, match=r"every rank must ask for the same transport \(this rank: 'zmq', by transport\); "
                                            r"pass the same transport= on every rank"):
        agree_transport(sums(("zmq", GLOO), ("auto", GLOO)), 2, "zmq", GLOO, "transport")


def sums(*ranks):
    """Each rank's (choice, what it lacks), summed as the allreduce does."""
    votes = [transport_votes(choice, missing) for choice, missing in ranks]
    return [sum(column) for column in zip(*votes)]


GLOO = {"mpi": "Horovod runs on Gloo", "zmq": None}  # horovodrun --gloo with pyzmq
BARE = {"mpi": "Horovod runs on Gloo", "zmq": "pyzmq is not installed"}


def test_agree_transport_decides_alike_on_every_rank():
    assert agree_transport(sums(("auto", {}), ("auto", {})), 2, "auto", {}) == "mpi"  # MPI first when all have it
    assert agree_transport(sums(("auto", GLOO), ("auto", GLOO)), 2, "auto", GLOO) == "zmq"  # horovodrun --gloo
    assert agree_transport(sums(("auto", GLOO), ("auto", BARE)), 2, "auto", GLOO) == "horovod"  # one rank lacks it
    assert agree_transport(sums(("auto", {}), ("auto", GLOO)), 2, "auto", {}) == "zmq"  # MPI on one rank only
    assert agree_transport(sums(("horovod", {}), ("horovod", {})), 2, "horovod", {}) == "horovod"
    assert agree_transport(sums(("zmq", {}), ("zmq", GLOO)), 2, "zmq", {}) == "zmq"  # asked for, though MPI is there
    with pytest.raises(StrategyError, match=r"=mpi needs mpi point-to-point on every rank \(1 of 2 lack it; here: no\); "
                                            r"launch with mpirun or srun, or use auto"):
        agree_transport(sums(("mpi", {}), ("mpi", {"mpi": "no"})), 2, "mpi", {"mpi": "no"})
    with pytest.raises(StrategyError, match=r"=zmq needs zmq point-to-point on every rank \(2 of 2 lack it; here: pyzmq "
                                            r"is not installed\); install pyzmq on every host"):
        agree_transport(sums(("zmq", BARE), ("zmq", BARE)), 2, "zmq", BARE)
    with pytest.raises(StrategyError, match=r"every rank must ask for the same transport \(this rank: 'mpi', by "
                                            r"DUALFRAME_PIPELINE_TRANSPORT\)"):
        agree_transport(sums(("mpi", {}), ("auto", {})), 2, "mpi", {})
