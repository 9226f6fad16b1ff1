"""A process outside a pipeline's job that sends forged and malformed frames to its ZeroMQ ports, until stopped.

    python stranger.py --sizes 192,128,64 tcp://127.0.0.1:5555 tcp://127.0.0.1:5556

Knows what an outsider can know: the ports, the frame layout and the message sizes, not the secret.
Each round sends to every endpoint raw TCP garbage (no ZeroMQ greeting), then as ZeroMQ messages: one
frame, three frames, empty frames, the old unsealed header ``(rank, tag)`` with right-sized bodies
(the frames that crashed issue 30's job), sealed-shape headers with the right length but a made-up
MAC for every (sender, tag, size) and counters 1.., and a 1 MiB body. It prints ``round 1: N messages``
once the first round left, then goes on until killed.
"""
from __future__ import annotations

import argparse
import os
import socket
import struct
import time
from typing import List

import zmq

FIELDS = struct.Struct("<qqqQQ")  # sender, receiver, tag, counter, length: dualframe.pipeline.zmq_auth's layout
MAC_BYTES = 32


def messages(receiver: int, ranks: int, tags: int, sizes: List[int], counter: int) -> List[List[bytes]]:
    """One round's forged messages to ``receiver``: every shape an outsider could try."""
    forged = [[b"garbage"], [b"a", b"b", b"c"], [b"", b""], [b"\0" * (FIELDS.size + MAC_BYTES), os.urandom(1 << 20)]]
    for sender in range(ranks):
        for tag in range(tags):
            for size in sizes:
                body = os.urandom(size)
                forged.append([struct.pack("<qq", sender, tag), body])
                forged.append([FIELDS.pack(sender, receiver, tag, counter + tag, size) + os.urandom(MAC_BYTES), body])
    return forged


def raw_garbage(endpoint: str) -> None:
    """Bytes that are not ZeroMQ at all, on a plain TCP connection."""
    host, port = endpoint[len("tcp://"):].rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as connection:
        connection.sendall(os.urandom(4096))


def send_round(endpoints: List[str], sizes: List[int], tags: int, counter: int) -> int:
    """Send one round to every endpoint; return how many ZeroMQ messages left (the context's end waits for them)."""
    context, sent = zmq.Context(), 0
    for receiver, endpoint in enumerate(endpoints):
        raw_garbage(endpoint)
        push = context.socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 10_000)
        push.connect(endpoint)
        for frames in messages(receiver, len(endpoints), tags, sizes, counter):
            push.send_multipart(frames)
            sent += 1
        push.close()
    context.term()  # returns once every message left (LINGER)
    return sent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("endpoints", nargs="+")
    parser.add_argument("--sizes", required=True, help="message sizes in bytes, comma-separated")
    parser.add_argument("--tags", type=int, default=16)
    args = parser.parse_args()
    sizes = [int(size) for size in args.sizes.split(",")]
    first = send_round(args.endpoints, sizes, args.tags, counter=1)
    print(f"round 1: {first} messages", flush=True)
    counter = 1
    while True:  # more during the training, with higher counters
        counter += args.tags
        send_round(args.endpoints, sizes, args.tags, counter)
        time.sleep(0.05)


if __name__ == "__main__":
    main()
