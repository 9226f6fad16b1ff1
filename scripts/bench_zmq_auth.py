"""What the MAC on every ZeroMQ pipeline message costs: sealed against unsealed messages, per activation size.

    .venv/bin/python scripts/bench_zmq_auth.py

One process, two ``ZMQDirect`` over the loopback as ranks 0 and 1 (no framework, no launcher): rank 0
sends a message of each size, rank 1 receives it into a buffer (post, send, wait), ``--messages`` per
block. "sealed" is the transport as it ships (``zmq_auth.MessageSeal``: HMAC-SHA256 over header and
bytes on both sides); "unsealed" the same frames and checks with the MAC left out. Interleaved rounds
(A B A B ...), median of the per-round ratios sealed / unsealed seconds per message; then the MAC alone
(seal + open) in microseconds per message and GB/s.
"""
import statistics
import time

import bench_common
from dualframe.observe.bench_rounds import interleaved
from dualframe.pipeline.zmq_auth import DIGEST_BYTES, MessageSeal, new_secret
from dualframe.pipeline.zmq_direct import ZMQDirect, open_zmq

SIZES = {"64 KiB": 64 << 10, "256 KiB": 256 << 10, "1 MiB": 1 << 20, "4 MiB": 4 << 20}


class Unsealed(MessageSeal):
    """The same frames, counters and checks, without hashing: what the transport cost before the MAC."""

    def _mac(self, fields: bytes, body: memoryview) -> bytes:
        return bytes(DIGEST_BYTES)


def two_ranks(sealed: bool) -> "tuple[ZMQDirect, ZMQDirect]":
    """Ranks 0 and 1 of one pipeline in this process; each one's gather hands it the addresses known so far."""
    entries: list = []

    def gather(entry: tuple) -> list:
        entries.append(entry)
        return [entries[0], entry]

    sender = open_zmq(0, gather, memoryview, lambda buffer: (memoryview(buffer), lambda: buffer))
    receiver = open_zmq(1, gather, memoryview, lambda buffer: (memoryview(buffer), lambda: buffer))
    sender.peers[1] = receiver.peers[1]
    if not sealed:
        for direct in (sender, receiver):
            direct.seal = Unsealed(direct.seal.secret, direct.rank, 2)
    return sender, receiver


def timed_messages(sender: ZMQDirect, receiver: ZMQDirect, size: int, messages: int) -> float:
    """Seconds per message of ``size`` bytes from rank 0 to rank 1 (the receive posted first, as a pipeline does)."""
    data, buffer = bytearray(size), bytearray(size)
    start = time.perf_counter()
    for _ in range(messages):
        handle = receiver.receive(buffer, source=0, tag=0)
        sender.send(data, dest=1, tag=0)
        assert receiver.done(handle, timeout=30.0)
    return (time.perf_counter() - start) / messages


def mac_alone(size: int, messages: int) -> float:
    """Seconds per message for sealing (sender) plus opening (receiver) ``size`` bytes."""
    secret, body = new_secret(), bytes(size)
    seal, opener = MessageSeal(secret, 0, 2), MessageSeal(secret, 1, 2)
    start = time.perf_counter()
    for _ in range(messages):
        assert opener.open([seal.seal(1, 0, body), body]) is not None
    return (time.perf_counter() - start) / messages


def main() -> None:
    args = bench_common.parser(__doc__, rounds=7, messages=40).parse_args()
    ways = {"sealed": two_ranks(True), "unsealed": two_ranks(False)}
    print(f"ZeroMQ pipeline messages over the loopback, one process, {args.rounds} rounds of {args.messages} messages")
    for label, size in SIZES.items():
        times = interleaved({name: (lambda pair=pair: timed_messages(*pair, size, args.messages))
                             for name, pair in ways.items()}, args.rounds)
        ratios = [a / b for a, b in zip(times["sealed"], times["unsealed"])]
        mac = statistics.median(mac_alone(size, args.messages) for _ in range(args.rounds))
        print(f"{label:>8}: sealed / unsealed seconds per message: median {statistics.median(ratios):.2f} "
              f"(rounds: {' '.join(f'{r:.2f}' for r in ratios)}); per message unsealed "
              f"{statistics.median(times['unsealed']) * 1e6:.0f} us, sealed {statistics.median(times['sealed']) * 1e6:.0f} us; "
              f"MAC alone (seal + open) {mac * 1e6:.0f} us, {2 * size / mac / 1e9:.2f} GB/s hashed")


if __name__ == "__main__":
    main()
