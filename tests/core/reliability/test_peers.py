"""dualframe.reliability.peers: the ranks an error's text names, on error texts captured from Gloo, Open MPI, Slurm and the pipelines."""
import pytest

from dualframe.errors import StrategyError
from dualframe.reliability.peers import Peer, PeerTable, this_peer

# Two nodes of the test cluster (tests/cluster), one rank each, seen from rank 0; and a 4-rank job, 2 per host.
CLUSTER = PeerTable([Peer(0, "dfn1", ("10.203.7.1",), 13763), Peer(1, "dfn2", ("10.203.7.2",), 4242)], me=0)
FOUR = PeerTable([Peer(0, "a", ("10.0.0.1",), 10), Peer(1, "a", ("10.0.0.1",), 11),
                  Peer(2, "b.example.org", ("10.0.0.2", "192.168.5.2"), 12), Peer(3, "b.example.org", ("10.0.0.2",), 13)],
                 me=1)

# Captured from real runs (Horovod 0.28.1, Gloo, Open MPI 4.1, Slurm; tests/cluster and horovodrun on one host).
GLOO_CLOSED = ("[0]: Horovod background loop uncaught exception: [/tmp/tmp.INR9hmDfSR/horovod-0.28.1/third_party/gloo/"
               "gloo/transport/tcp/pair.cc:598] Connection closed by peer [10.203.7.2]:40346")
GLOO_RESET = ("[/tmp/tmp.INR9hmDfSR/horovod-0.28.1/third_party/gloo/gloo/transport/tcp/pair.cc:589] "
              "Read error [10.0.0.2]:14734: Connection reset by peer")
GLOO_TIMEOUT = ("[/tmp/tmp.INR9hmDfSR/horovod-0.28.1/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] "
                "Timed out waiting 30000ms for recv operation to complete")
SHUT_DOWN = ("Horovod has been shut down. This was caused by an exception on one of the ranks or an attempt to "
             "allreduce, allgather or broadcast a tensor after one of the ranks finished execution.")
MPI_SIGNAL = "mpirun noticed that process rank 1 with PID 4242 on node dfn2 exited on signal 9 (Killed)."
MPI_ABORT = "Process name: [[34567,1],1]\nExit code:    3"
SRUN_KILLED = "srun: error: dfn2: task 1: Killed"
SRUN_NODE = "srun: error: Node failure on dfn2"
PIPELINE = ("stage 0 (rank 0) waiting for the shape of x from rank 1: rank 1 closed its connection (its process ended); "
            "a neighbouring stage failed or exited")
ZMQ = "cannot reach tcp://10.203.7.2:39211 (rank ?)"


@pytest.mark.parametrize("text", [GLOO_CLOSED, MPI_SIGNAL, MPI_ABORT, SRUN_KILLED, SRUN_NODE, PIPELINE, ZMQ])
def test_each_launchers_text_names_the_lost_rank(text):
    assert CLUSTER.named_in(text) == [1]
    assert CLUSTER.describe(CLUSTER.named_in(text)) == "rank 1 (host dfn2, pid 4242)"


@pytest.mark.parametrize("text", [GLOO_TIMEOUT, SHUT_DOWN, ""])
def test_texts_that_name_no_peer_name_none(text):
    assert CLUSTER.named_in(text) == []


def test_an_address_or_host_names_every_other_rank_there_and_never_this_one():
    assert FOUR.named_in(GLOO_RESET) == [2, 3]            # Gloo's port is its own: both ranks on that host
    assert FOUR.named_in("[10.0.0.1]:5555") == [0]        # this rank (1) shares the host but is not lost
    assert FOUR.named_in("connect to 192.168.5.2 failed") == [2]
    assert FOUR.named_in("srun: error: Node failure on b") == [2, 3]   # a short name matches the long one
    assert FOUR.named_in("process rank 1 with PID 11 on node a") == []  # itself
    assert FOUR.named_in("10.0.0.10 and 110.0.0.1") == []  # no partial address matches


def test_a_rank_in_the_text_wins_over_its_host():
    assert FOUR.named_in("process rank 3 with PID 13 on node b.example.org exited on signal 9") == [3]


def test_tables_are_checked():
    with pytest.raises(StrategyError, match=r"rank order 0..1 \(ranks: \[1, 0\]\)"):
        PeerTable([Peer(1, "a", (), 1), Peer(0, "b", (), 2)], me=0)
    with pytest.raises(StrategyError, match=r"me must be a rank of the table \(me: 2, ranks: 2\)"):
        PeerTable([Peer(0, "a", (), 1), Peer(1, "b", (), 2)], me=2)
    with pytest.raises(StrategyError, match="malformed peer entry"):
        Peer.from_json({"rank": 0})


def test_this_peer_round_trips_through_json():
    me = this_peer(3, port=5000, reach="127.0.0.1")
    assert Peer.from_json(me.to_json()) == me
    assert me.rank == 3 and me.port == 5000 and not any(a.startswith("127.") for a in me.addresses)
