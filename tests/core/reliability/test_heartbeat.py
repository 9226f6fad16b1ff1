"""dualframe.reliability.heartbeat and lost_rank in one process: three ranks' heartbeats on real UDP sockets (loopback).

Each "rank" is a Heartbeat with its own socket; a rank is lost by stopping its thread (silence, as a
cut link), by closing its socket (the port refuses, as a killed process) or by its ``bye``.
"""
import contextlib
import os
import pathlib
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from dualframe.errors import StrategyError
from dualframe.reliability import heartbeat, lost_rank
from dualframe.reliability.heartbeat import BEAT, Heartbeat, Seal, peer_timeout
from dualframe.reliability.peers import Peer, PeerTable

SECRET = bytes(range(32))


@contextlib.contextmanager
def three_ranks(notice_after=60.0, lines=None):
    """Three running heartbeats and their sockets; every one stopped at the end."""
    sockets = [heartbeat_socket() for _ in range(3)]
    peers = [Peer(r, f"node{r}", (f"10.0.0.{r + 1}",), 100 + r, s.getsockname()[1], "127.0.0.1")
             for r, s in enumerate(sockets)]
    beats = [Heartbeat(PeerTable(peers, r), Seal(SECRET, r), s, notice_after,
                       (lines.append if lines is not None else None)) for r, s in enumerate(sockets)]
    for beat in beats:
        beat.start()
    try:
        yield beats, sockets
    finally:
        for beat in beats:
            beat.stop()


def heartbeat_socket():
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", 0))
    return sock


def wait_until(condition, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.05)
    return condition()


def test_a_silent_rank_is_lost_and_noticed_once():
    lines = []
    with three_ranks(notice_after=1.5, lines=lines) as (beats, _):
        time.sleep(1.0)
        assert beats[0].lost(1.5) == []
        beats[2].stop()                                    # rank 2 goes silent: its link cut, its process stopped
        assert wait_until(lambda: [r for r, _ in beats[0].lost(1.5)] == [2])
        assert [r for r, _ in beats[1].lost(1.5)] == [2]
        why = beats[0].lost(1.5)[0][1]
        assert why.startswith("no heartbeat for ")
        assert wait_until(lambda: len(lines) >= 2)
        time.sleep(1.0)
        assert len(lines) == 2 and all(line.startswith("lost rank 2 (host node2, pid 102): no heartbeat for ")
                                       for line in lines)  # once per survivor


def test_a_closed_port_is_a_process_that_ended():
    with three_ranks() as (beats, sockets):
        beats[1].stop()
        time.sleep(0.6)
        sockets[1].close()                                 # rank 1's process is gone: its port refuses
        assert wait_until(lambda: beats[0].lost(60) == [(1, "its process ended (its heartbeat port refuses)")])
        assert beats[0].describe(beats[0].lost(60)) == ("lost rank 1 (host node1, pid 101): its process ended "
                                                         "(its heartbeat port refuses)")


def test_a_bye_says_who_failed_and_who_only_finished():
    with three_ranks() as (beats, _):
        beats[2].bye("failed", "failed: RuntimeError: injected fault")
        beats[1].bye("finished")
        assert wait_until(lambda: len(beats[0].left) == 2)
        assert beats[0].lost(60) == [(2, "it failed: RuntimeError: injected fault")]
        assert beats[0].ended() == [(1, "it had finished its script")]


def test_forged_replayed_and_own_datagrams_are_dropped():
    seal, other = Seal(SECRET, 0), Seal(SECRET, 1)
    datagram = other.seal(BEAT, "")
    assert seal.open(datagram) == (1, BEAT, "")
    assert seal.open(datagram) is None                            # replayed
    assert seal.open(Seal(bytes(32), 1).seal(BEAT, "")) is None   # another secret
    assert seal.open(datagram[:-1] + bytes([datagram[-1] ^ 1])) is None
    assert seal.open(Seal(SECRET, 0).seal(BEAT, "")) is None      # this rank's own
    assert seal.open(b"x" * 10) is None


def test_start_gathers_every_rank_and_a_rank_with_its_heartbeat_off_is_not_waited_for(monkeypatch):
    monkeypatch.setenv("DUALFRAME_PIPELINE_ADDRESS", "127.0.0.1")
    size, sent, barrier = 3, [b""] * 3, threading.Barrier(3)

    def gather_for(rank):
        def gather(data, name):
            assert name == "dualframe.peers"
            sent[rank] = data
            barrier.wait(timeout=10)
            return list(sent)
        return gather

    results = [None] * size

    def rank_main(rank):
        results[rank] = heartbeat.start(gather_for(rank), rank, print, on=rank != 2)

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=20)
    (table0, beat0), (table1, beat1), (table2, beat2) = results
    try:
        assert beat2 is None and table2.peers[2].port == 0 and table2.peers[0].port > 0
        assert [p.rank for p in table0.peers] == [0, 1, 2] and table1.me == 1
        assert sorted(beat0.heard) == [1] and sorted(beat1.heard) == [0]   # rank 2 (off) is not expected to beat
        assert wait_until(lambda: beat0.seal._last.get(1, 0) > 2)           # rank 1's beats arrive, sealed
        assert beat0.lost(1.5) == []
    finally:
        beat0.stop()
        beat1.stop()


def test_who_was_lost_falls_back_to_the_error_text_then_the_only_other_rank(monkeypatch):
    table = PeerTable([Peer(0, "dfn1", ("10.203.7.1",), 1), Peer(1, "dfn2", ("10.203.7.2",), 4242)], me=0)
    monkeypatch.setattr(lost_rank, "_state", {"table": table, "heartbeat": None})
    assert lost_rank.who_was_lost("Connection closed by peer [10.203.7.2]:40346") == (
        "lost rank 1 (host dfn2, pid 4242) (named by the error)")
    assert lost_rank.who_was_lost("Horovod has been shut down.") == "lost rank 1 (host dfn2, pid 4242) (the only other rank)"


def test_who_was_lost_waits_for_the_heartbeats_evidence(monkeypatch):
    with three_ranks() as (beats, sockets):
        monkeypatch.setattr(lost_rank, "_state", {"table": beats[0].table, "heartbeat": beats[0]})
        beats[2].stop()
        sockets[2].close()
        started = time.monotonic()
        assert lost_rank.who_was_lost("Horovod has been shut down.") == (
            "lost rank 2 (host node2, pid 102): its process ended (its heartbeat port refuses)")
        assert time.monotonic() - started < lost_rank.WAIT_S


def test_the_timeout_variable_is_checked():
    assert peer_timeout({"DUALFRAME_PEER_TIMEOUT": "0"}) == 0.0
    for bad in ("-1", "soon", "nan"):
        with pytest.raises(StrategyError, match=r"DUALFRAME_PEER_TIMEOUT must be a number of seconds >= 0"):
            peer_timeout({"DUALFRAME_PEER_TIMEOUT": bad})


def test_a_two_rank_job_names_the_other_rank_with_its_last_heartbeat_when_nothing_else_is_known(monkeypatch):
    monkeypatch.setattr(lost_rank, "WAIT_S", 0.3)
    sockets = [heartbeat_socket(), heartbeat_socket()]
    peers = [Peer(r, f"node{r}", (), 100 + r, s.getsockname()[1], "127.0.0.1") for r, s in enumerate(sockets)]
    beat = Heartbeat(PeerTable(peers, 0), Seal(SECRET, 0), sockets[0])  # not started: rank 1 stays "just heard"
    monkeypatch.setattr(lost_rank, "_state", {"table": beat.table, "heartbeat": beat})
    said = lost_rank.who_was_lost("Horovod has been shut down.")
    assert said.startswith("lost rank 1 (host node1, pid 101) (the only other rank; its last heartbeat 0.")


SIGTERMED = """
import os, socket, sys, time
from dualframe.reliability import lost_rank
from dualframe.reliability.heartbeat import Heartbeat, Seal
from dualframe.reliability.peers import Peer, PeerTable
sockets = [socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in range(2)]
for sock in sockets:
    sock.bind(("127.0.0.1", 0))
peers = [Peer(r, f"node{r}", (), 100 + r, s.getsockname()[1], "127.0.0.1") for r, s in enumerate(sockets)]
beat = Heartbeat(PeerTable(peers, 0), Seal(bytes(32), 0), sockets[0])
sockets[1].close()                                    # rank 1 was killed: its port refuses
lost_rank._state.update(table=beat.table, heartbeat=beat, write=lambda line: print("said:", line, flush=True))
print("watching:", lost_rank.watch_sigterm(), flush=True)
time.sleep(60)
"""


def test_sigterm_names_the_lost_rank_and_exits_143(tmp_path):
    script = tmp_path / "sigtermed.py"
    script.write_text(SIGTERMED)
    root = pathlib.Path(__file__).resolve().parents[3]
    child = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONPATH": str(root)})
    assert child.stdout.readline().strip() == "watching: True"
    child.send_signal(signal.SIGTERM)
    out, _ = child.communicate(timeout=30)
    assert child.returncode == 143, out
    assert out.strip() == ("said: ended by SIGTERM (the launcher or the scheduler ends the job); lost rank 1 "
                           "(host node1, pid 101): its process ended (its heartbeat port refuses)")


def test_sigterm_is_left_alone_where_someone_else_handles_it():
    read, write = os.pipe()
    os.set_blocking(write, False)
    previous = signal.set_wakeup_fd(write)
    try:
        assert lost_rank.watch_sigterm() is False              # asyncio's wakeup fd: kept
        assert signal.set_wakeup_fd(write) == write and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    finally:
        signal.set_wakeup_fd(previous)
        os.close(read)
        os.close(write)
