"""dualframe.pipeline.zmq_direct and .direct in one process: two ranks' ZMQDirect over the loopback, matching, strangers, the choice."""
from __future__ import annotations

import array
import gc
import socket
import struct
import threading
import time

import pytest

from dualframe.errors import StrategyError
from dualframe.pipeline import direct as direct_module
from dualframe.pipeline.layout import PeerLostError
from dualframe.pipeline.link import wait_for
from dualframe.pipeline.zmq_auth import HEAD_BYTES, host_address
from dualframe.pipeline.zmq_direct import endpoints, open_zmq

zmq = pytest.importorskip("zmq")


def byte_view(values):
    return memoryview(values).cast("B")


def receive_into(buffer):
    return byte_view(buffer), lambda: buffer


def pair():
    """Two ZMQDirect in one process, as ranks 0 and 1 (the gather hands each the other's address)."""
    entries = []

    def gather_for(rank):
        def gather(entry):
            entries.append(entry)
            return list(entries) if rank == 1 else [entry, ("127.0.0.1", 1, "", socket.gethostname(), (b"", ""))]
        return gather

    first = open_zmq(0, gather_for(0), byte_view, receive_into)
    second = open_zmq(1, gather_for(1), byte_view, receive_into)
    first.peers[1] = second.peers[1]  # rank 0 was built before rank 1 bound: tell it now
    return first, second


def test_messages_match_by_sender_and_tag_oldest_first_whatever_the_arrival_order():
    first, second = pair()
    for tag, value in [(6, 1.0), (1, 2.0), (6, 3.0)]:  # two messages with tag 6: they keep their order
        assert first.done(first.send(array.array("d", [value] * 4), dest=1, tag=tag), timeout=1.0)
    time.sleep(0.05)
    late = second.receive(array.array("d", [0.0] * 4), source=0, tag=1)  # posted after its message arrived
    assert second.done(late, timeout=5.0) and list(second.result(late)) == [2.0] * 4
    a, b = (second.receive(array.array("d", [0.0] * 4), source=0, tag=6) for _ in range(2))
    assert second.done(b, timeout=5.0) and second.done(a, timeout=5.0)
    assert (list(second.result(a)), list(second.result(b))) == ([1.0] * 4, [3.0] * 4)
    early = first.receive(array.array("f", [0.0] * 3), source=1, tag=0)  # posted before its message is sent
    assert first.done(early, timeout=0.05) is False  # nothing yet: bounded
    second.send(array.array("f", [5.0, 6.0, 7.0]), dest=0, tag=0)
    assert first.done(early, timeout=5.0) and list(first.result(early)) == [5.0, 6.0, 7.0]


def test_a_message_of_another_size_is_refused():
    first, second = pair()
    first.send(array.array("d", [1.0] * 4), dest=1, tag=0)
    with pytest.raises(ValueError, match="message 0 from rank 0 has 32 bytes where 16 were expected"):
        second.done(second.receive(array.array("d", [0.0] * 2), source=0, tag=0), timeout=5.0)


@pytest.mark.parametrize("connected_first", [True, False], ids=["after-connecting", "before-connecting"])
def test_a_peer_whose_process_ended_stops_the_wait(connected_first):
    first, second = pair()
    if connected_first:  # rank 0 talked to rank 1 before it went: the connection drops
        first.send(array.array("d", [1.0]), dest=1, tag=9)
        assert second.done(second.receive(array.array("d", [0.0]), source=0, tag=9), timeout=5.0)
    else:  # rank 1 went before rank 0 ever connected: the connection is refused
        second.inbox.close(linger=0)
    waiting = first.receive(array.array("d", [0.0]), source=1, tag=0)
    second.inbox.close(linger=0)  # rank 1's process ends: its listening socket closes
    begin = time.monotonic()
    with pytest.raises(PeerLostError, match=r"^waiting for F0: rank 1 closed its connection \(its process ended\)"):
        wait_for(first, waiting, "waiting for F0", timeout=30.0)
    assert time.monotonic() - begin < 10
    assert first.stopped(ValueError("not a transport error")) is None


def test_closed_pipelines_do_not_make_a_live_peer_look_gone():
    for _ in range(4):  # sockets closed and their file descriptors reused, as pipelines come and go
        first, second = pair()
        second.send(array.array("d", [1.0]), dest=0, tag=0)
        assert first.done(first.receive(array.array("d", [0.0]), source=1, tag=0), timeout=5.0)
        del first, second
        gc.collect()
    first, second = pair()
    waiting = first.receive(array.array("d", [0.0]), source=1, tag=0)
    assert first.done(waiting, timeout=3.0) is False  # silent but alive: the bounded wait, no PeerLostError


def test_a_wait_sleeps_in_zeromq_until_the_message_lands():
    first, second = pair()
    first.done(first.send(array.array("d", [0.0]), dest=1, tag=1), timeout=1.0)  # connected before timing
    assert second.done(second.receive(array.array("d", [0.0]), source=0, tag=1), timeout=5.0)
    assert not second.done(second.receive(array.array("d", [0.0]), source=0, tag=9), timeout=0.01)  # imports done
    waiting = second.receive(array.array("d", [0.0] * 4), source=0, tag=2)
    sent = []

    def send_late():
        first.send(array.array("d", [4.0] * 4), dest=1, tag=2)
        sent.append(time.monotonic() - start)

    timer = threading.Timer(0.3, send_late)
    start, cpu = time.monotonic(), time.thread_time()
    timer.start()
    assert second.done(waiting, timeout=5.0) and list(second.result(waiting)) == [4.0] * 4
    wall, cpu = time.monotonic() - start, time.thread_time() - cpu
    timer.join()
    # Ended by the message (sent at 0.3 s, later when the box is loaded), long before the 5 s timeout.
    assert 0.3 <= wall < sent[0] + 1.0, f"the message was sent at {sent[0]:.3f} s, the wait ended at {wall:.3f} s"
    # Woken by the socket, not by a clock: a few wakeups, no core held.
    assert cpu < 0.05 * wall, f"the waiting thread used {cpu:.4f} s of {wall:.3f} s"


def test_endpoints_are_the_addresses_the_ranks_listen_on():
    assert endpoints([("127.0.0.1", 1, "", "a", (b"k", "header")), ("10.0.0.2", 2, "", "b", (b"", ""))]) == \
        ["tcp://127.0.0.1:1", "tcp://10.0.0.2:2"]
    assert host_address({"DUALFRAME_PIPELINE_ADDRESS": "192.168.1.5", "HOROVOD_HOSTNAME": "x"}) == "192.168.1.5"
    assert host_address({"HOROVOD_HOSTNAME": "localhost"}) == "127.0.0.1"


def test_a_job_on_one_host_listens_on_the_loopback_only():
    first, second = pair()
    for side in (first, second):
        endpoint = side.inbox.getsockopt(zmq.LAST_ENDPOINT).decode()
        assert endpoint.startswith("tcp://127.0.0.1:"), endpoint


@pytest.mark.parametrize("scope", ["header", "message"])
def test_strangers_messages_are_dropped_and_counted_and_the_ranks_still_talk(scope, monkeypatch):
    monkeypatch.setenv("DUALFRAME_PIPELINE_MAC", scope)
    first, second = pair()
    assert first.seal.whole == second.seal.whole == (scope == "message")
    stranger = zmq.Context.instance().socket(zmq.PUSH)
    stranger.connect(second.peers[1])
    forged = [[b"garbage"], [struct.pack("<qq", 0, 0), b"\0" * 7],  # one frame; the old unsealed header
              [b"\0" * HEAD_BYTES, b"\0" * 32],  # a header of the right size, its length wrong
              [struct.pack("<qqqQQ", 0, 1, 0, 1, 32) + b"\1" * (HEAD_BYTES - 40), b"\0" * 32],  # right shape, no key
              [b"a", b"b", b"c"], [b"", b""]]
    for frames in forged:
        stranger.send_multipart(frames)
    first.send(array.array("d", [2.0] * 4), dest=1, tag=0)
    with pytest.warns(RuntimeWarning, match="dropped a message that is not from this job's ranks") as caught:
        got = second.receive(array.array("d", [0.0] * 4), source=0, tag=0)
        assert second.done(got, timeout=5.0) and list(second.result(got)) == [2.0] * 4
        idle = second.receive(array.array("d", [0.0]), source=0, tag=99)  # nothing comes: drains the rest
        deadline = time.monotonic() + 5
        while second.dropped < len(forged) and time.monotonic() < deadline:
            second.done(idle, timeout=0.1)
    assert second.dropped == len(forged) and first.dropped == 0 and len(caught) == 1  # one warning
    got = second.receive(array.array("d", [0.0] * 4), source=0, tag=0)  # the genuine messages still come through
    first.send(array.array("d", [3.0] * 4), dest=1, tag=0)
    assert second.done(got, timeout=5.0) and list(second.result(got)) == [3.0] * 4
    stranger.close(linger=0)


def test_a_rank_that_cannot_listen_raises_on_every_rank(monkeypatch):
    monkeypatch.setenv("DUALFRAME_PIPELINE_ADDRESS", "192.0.2.1")  # TEST-NET-1: no interface of this host
    here = socket.gethostname()
    with pytest.raises(StrategyError, match=r"could not listen where its peers reach it \(rank 0: .*address "
                                            r"'192.0.2.1'\)\); set DUALFRAME_PIPELINE_ADDRESS"):
        open_zmq(0, lambda entry: [entry, ("127.0.0.1", 1, "", here, (b"", ""))], byte_view, receive_into)
    monkeypatch.setenv("DUALFRAME_PIPELINE_ADDRESS", "127.0.0.1")  # this rank can; rank 1 could not: the same error
    with pytest.raises(StrategyError, match=r"rank 1: no such address \(address '10.0.0.9'\)"):
        open_zmq(0, lambda entry: [entry, ("10.0.0.9", 0, "no such address", here, (b"", ""))], byte_view,
                 receive_into)
    # The launcher's variables said one host, the host names say two: the loopback would not reach.
    with pytest.raises(StrategyError, match=rf"rank 0 listens on 127.0.0.1 \(host {here}\), which ranks on "
                                            r"elsewhere cannot reach"):
        open_zmq(0, lambda entry: [entry, ("10.0.0.9", 5, "", "elsewhere", (b"", ""))], byte_view, receive_into)


def test_open_direct_opens_what_every_rank_agreed_on(monkeypatch):
    sums = {"zmq": [0, 2, 4], "horovod": [0, 2, 6]}  # two ranks under horovodrun --gloo, both with pyzmq

    def open_with(choice):
        monkeypatch.setenv("DUALFRAME_PIPELINE_TRANSPORT", choice)
        votes = []
        opened = direct_module.open_direct("", False, 0, 2, 8, lambda v: votes.append(v) or sums[choice],
                                           lambda entry: [entry, entry], byte_view, receive_into)
        return votes, opened

    votes, opened = open_with("horovod")
    assert votes == [[1, 1, 3]] and opened is None
    votes, opened = open_with("zmq")
    assert votes == [[0, 1, 2]] and opened.name == "zmq"
    monkeypatch.setenv("DUALFRAME_PIPELINE_TRANSPORT", "mpi")
    with pytest.raises(StrategyError, match="=mpi needs mpi point-to-point"):
        direct_module.open_direct("", False, 0, 2, 8, lambda v: [0, 2, 2], lambda e: [e, e], byte_view, receive_into)


def test_the_transport_argument_overrides_the_variable_in_the_vote(monkeypatch):
    monkeypatch.setenv("DUALFRAME_PIPELINE_TRANSPORT", "zmq")
    votes = []
    opened = direct_module.open_direct("", False, 0, 2, 8, lambda v: votes.append(v) or [0, 2, 6],
                                       lambda entry: [entry, entry], byte_view, receive_into, transport="horovod")
    assert votes == [[1, 1, 3]] and opened is None  # voted "horovod" (index 3), not the variable's zmq
    with pytest.raises(StrategyError, match=r"^transport=mpi needs mpi point-to-point on every rank \(2 of 2 lack it; "
                                            r"here: Horovod runs on Gloo, not MPI"):
        direct_module.open_direct("", False, 0, 2, 8, lambda v: [0, 2, 2], lambda e: [e, e], byte_view, receive_into,
                                  transport="mpi")


def test_a_stage_on_a_device_has_neither_point_to_point():
    lacking = direct_module.missing("cuda:0", True, 0, 2, 8)
    assert set(lacking) == {"mpi", "zmq"} and all(r.startswith("the stage is on cuda:0") for r in lacking.values())
    assert direct_module.missing("", False, 0, 2, 8)["mpi"] == "Horovod runs on Gloo, not MPI (horovodrun --gloo)"
