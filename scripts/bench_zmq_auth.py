"""What the MAC on every ZeroMQ pipeline message costs: sealed against unsealed messages, per activation size.

    .venv/bin/python scripts/bench_zmq_auth.py

One process, two ``ZMQDirect`` over the loopback as ranks 0 and 1 (no framework, no launcher): rank 0
sends a message of each size, rank 1 receives it into a buffer (post, send, wait), ``--messages`` per
block. "header" is the transport as it ships (``zmq_auth.MessageSeal``: HMAC-SHA256 over the header,
sealed by the sender and checked by the receiver); "message" the same with the bytes under the MAC
too (``DUALFRAME_PIPELINE_MAC=message``); "unsealed" the same frames and checks with no hashing.
Interleaved rounds (A B C A B C ...), median of the per-round ratios of seconds per message over
"unsealed"; then the MAC alone (seal + open) in microseconds per message.
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


def two_ranks(scope: str) -> "tuple[ZMQDirect, ZMQDirect]":
    """Ranks 0 and 1 of one pipeline in this process; each one's gather hands it the addresses known so far."""
    entries: list = []

    def gather(entry: tuple) -> list:
        entries.append(entry)
        return [entries[0], entry]

    sender = open_zmq(0, gather, memoryview, lambda buffer: (memoryview(buffer), lambda: buffer))
    receiver = open_zmq(1, gather, memoryview, lambda buffer: (memoryview(buffer), lambda: buffer))
    sender.peers[1] = receiver.peers[1]
    kind = Unsealed if scope == "unsealed" else MessageSeal
    for direct in (sender, receiver):
        direct.seal = kind(direct.seal.secret, direct.rank, 2, whole=scope == "message")
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


def mac_alone(size: int, messages: int, whole: bool) -> float:
    """Seconds per message for sealing (sender) plus opening (receiver) a message of ``size`` bytes."""
    secret, body = new_secret(), bytes(size)
    seal, opener = MessageSeal(secret, 0, 2, whole), MessageSeal(secret, 1, 2, whole)
    start = time.perf_counter()
    for _ in range(messages):
        assert opener.open([seal.seal(1, 0, body), body]) is not None
    return (time.perf_counter() - start) / messages


def main() -> None:
    args = bench_common.parser(__doc__, rounds=7, messages=40).parse_args()
    ways = {scope: two_ranks(scope) for scope in ("header", "message", "unsealed")}
    print(f"ZeroMQ pipeline messages over the loopback, one process, {args.rounds} rounds of {args.messages} messages")
    for label, size in SIZES.items():
        times = interleaved({name: (lambda pair=pair: timed_messages(*pair, size, args.messages))
                             for name, pair in ways.items()}, args.rounds)
        medians = {name: statistics.median(seconds) * 1e6 for name, seconds in times.items()}
        print(f"{label:>8}: per message unsealed {medians['unsealed']:.0f} us, header {medians['header']:.0f} us, "
              f"message {medians['message']:.0f} us")
        for scope in ("header", "message"):
            ratios = [a / b for a, b in zip(times[scope], times["unsealed"])]
            mac = statistics.median(mac_alone(size, args.messages, scope == "message") for _ in range(args.rounds))
            print(f"          {scope} / unsealed seconds per message: median {statistics.median(ratios):.2f} "
                  f"(rounds: {' '.join(f'{r:.2f}' for r in ratios)}); its MAC alone (seal + open) {mac * 1e6:.1f} us")


if __name__ == "__main__":
    main()
