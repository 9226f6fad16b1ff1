"""dualframe.pipeline.zmq_auth: the sealed message frames (genuine, forged, malformed, replayed) and the listening address."""
from __future__ import annotations

import struct
import warnings

import pytest

from dualframe.errors import StrategyError
from dualframe.pipeline.zmq_auth import (HEAD_BYTES, SECRET_BYTES, MessageSeal, host_address, job_seal,
                                         listen_address, mac_scope, new_secret, rank_0_share, unreachable)

FIELDS = struct.Struct("<qqqQQ")  # sender, receiver, tag, counter, length: written here as a stranger would


@pytest.fixture(params=[False, True], ids=["header", "message"])
def ranks(request):
    """Rank 0 and rank 1 of a 3-rank job, sharing one secret; the MAC over the header, or the whole message."""
    secret = new_secret()
    return MessageSeal(secret, 0, 3, whole=request.param), MessageSeal(secret, 1, 3, whole=request.param)


def quiet(seal, frames):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return seal.open(frames)


def test_a_sealed_message_opens_once_with_its_sender_tag_and_body(ranks):
    sender, receiver = ranks
    body = bytearray(b"\x01\x02" * 1000)
    head = sender.seal(1, 7, memoryview(body))
    assert len(head) == HEAD_BYTES == 40 + 32 and FIELDS.unpack(head[:40]) == (0, 1, 7, 1, 2000)
    source, tag, opened = receiver.open([head, bytes(body)])
    assert (source, tag, bytes(opened), receiver.dropped) == (0, 7, bytes(body), 0)
    later = sender.seal(1, 7, b"")  # counters go on per receiver; an empty body is a message too
    assert FIELDS.unpack(later[:40])[3] == 2 and receiver.open([later, b""]) == (0, 7, b"")


def test_replays_and_older_counters_are_dropped(ranks):
    sender, receiver = ranks
    first, second = sender.seal(1, 0, b"a"), sender.seal(1, 0, b"b")
    assert receiver.open([second, b"b"]) == (0, 0, b"b")
    assert quiet(receiver, [second, b"b"]) is None  # the same message again
    assert quiet(receiver, [first, b"a"]) is None  # an older one, genuine but late
    assert receiver.reasons == {"a replayed message": 2}


def test_forged_and_malformed_frames_are_dropped_each_for_its_reason(ranks):
    sender, receiver = ranks
    head = sender.seal(1, 3, b"x" * 16)
    tampered_head = head[:16] + struct.pack("<q", 4) + head[24:]  # another tag under the same MAC
    stranger = MessageSeal(new_secret(), 0, 3, whole=sender.whole).seal(1, 3, b"x" * 16)
    cases = {
        "not two frames": [[head], [head, b"x" * 16, b""], []],
        "a header of another size": [[head[:-1], b"x" * 16], [struct.pack("<qq", 0, 3), b"x" * 16]],
        "a body of another length than its header says": [[head, b"x" * 15], [b"\0" * HEAD_BYTES, b"x"]],
        "a MAC that does not match": [[tampered_head, b"x" * 16], [stranger, b"x" * 16],
                                      [FIELDS.pack(0, 1, 3, 9, 16) + b"\0" * 32, b"x" * 16]]
        + ([[head, b"y" * 16]] if sender.whole else []),  # other bytes under the header: only "message" sees them
    }
    with pytest.warns(RuntimeWarning, match=r"rank 1's pipeline socket dropped .* \(not two frames\)") as caught:
        for reason, frame_lists in cases.items():
            for frames in frame_lists:
                assert receiver.open(frames) is None, (reason, frames)
    assert len(caught) == 1  # warned once, however many were dropped
    assert receiver.reasons == {reason: len(frame_lists) for reason, frame_lists in cases.items()}
    assert receiver.dropped == 10 + sender.whole and receiver.open([head, b"x" * 16]) == (0, 3, b"x" * 16)  # the genuine one still opens


def test_another_ranks_message_is_not_taken(ranks):
    sender, receiver = ranks
    to_rank_2 = sender.seal(2, 0, b"z")  # genuine, but for rank 2: a copy sent to rank 1 is dropped
    outsider = MessageSeal(sender.secret, 5, 6, whole=sender.whole).seal(1, 0, b"z")  # a sender beyond the job's 3 ranks
    assert quiet(receiver, [to_rank_2, b"z"]) is None and quiet(receiver, [outsider, b"z"]) is None
    assert receiver.reasons == {"another rank's message": 2}


def test_rank_0_shares_the_secret_and_the_scope_every_rank_seals_with():
    assert len(new_secret()) == SECRET_BYTES and new_secret() != new_secret()
    with pytest.raises(ValueError, match="a pipeline secret has 32 bytes"):
        MessageSeal(b"short", 0, 2)
    assert rank_0_share(1, {"DUALFRAME_PIPELINE_MAC": "message"}) == (b"", "")
    shared = rank_0_share(0, {"DUALFRAME_PIPELINE_MAC": "message"})
    seal = job_seal([("127.0.0.1", 1, "", "a", shared), ("127.0.0.1", 2, "", "a", rank_0_share(1, {}))], rank=1)
    assert (seal.secret, seal.whole, seal.rank, seal.size) == (shared[0], True, 1, 2)  # rank 0's scope wins
    assert job_seal([("a", 1, "", "a", rank_0_share(0, {}))], rank=0).whole is False  # the header by default
    with pytest.raises(StrategyError, match="rank 0 shared a pipeline secret of 0 bytes and MAC scope ''"):
        job_seal([("127.0.0.1", 1, "", "a", (b"", ""))], rank=0)
    assert mac_scope({}) == "header"
    with pytest.raises(StrategyError, match=r"DUALFRAME_PIPELINE_MAC must be one of header, message "
                                            r"\(DUALFRAME_PIPELINE_MAC: 'body'\)"):
        rank_0_share(1, {"DUALFRAME_PIPELINE_MAC": "body"})  # refused on every rank, rank 0 or not


def test_one_host_listens_on_the_loopback_and_several_on_their_address():
    one_host = {"HOROVOD_RANK": "0", "HOROVOD_SIZE": "2", "HOROVOD_LOCAL_SIZE": "2"}
    assert listen_address(one_host) == listen_address({}) == "127.0.0.1"
    assert listen_address({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "4",
                           "OMPI_COMM_WORLD_LOCAL_SIZE": "4"}) == "127.0.0.1"
    two_hosts = {"HOROVOD_RANK": "0", "HOROVOD_SIZE": "2", "HOROVOD_LOCAL_SIZE": "1", "HOROVOD_HOSTNAME": "localhost"}
    assert listen_address(two_hosts) == host_address(two_hosts) == "127.0.0.1"  # localhost resolved
    assert listen_address(dict(two_hosts, DUALFRAME_PIPELINE_ADDRESS="10.0.0.7")) == "10.0.0.7"
    assert listen_address(dict(one_host, DUALFRAME_PIPELINE_ADDRESS="10.0.0.7")) == "10.0.0.7"  # asked for: taken


def test_a_loopback_address_is_refused_when_the_job_spans_hosts():
    assert unreachable([("127.0.0.1", 5, "", "a"), ("127.0.0.1", 6, "", "a")]) == ""
    assert unreachable([("10.0.0.1", 5, "", "a"), ("10.0.0.2", 6, "", "b")]) == ""
    assert unreachable([("10.0.0.1", 5, "", "a"), ("127.0.1.1", 6, "", "b"), ("10.0.0.3", 7, "", "c")]) == \
        "rank 1 listens on 127.0.1.1 (host b), which ranks on a, c cannot reach"  # /etc/hosts' 127.0.1.1 too


@pytest.mark.parametrize("everywhere", ["*", "0.0.0.0", "::", " "])
def test_every_interface_is_refused(everywhere):
    with pytest.raises(StrategyError, match=r"DUALFRAME_PIPELINE_ADDRESS must be one address of this host .*not "
                                            r"every interface"):
        listen_address({"DUALFRAME_PIPELINE_ADDRESS": everywhere})
