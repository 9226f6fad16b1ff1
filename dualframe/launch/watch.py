"""mpirun as a child whose failure to start is explained: Open MPI's own message names no host.

When a host cannot be reached, Open MPI 4.1 prints "ORTE was unable to reliably start one or more
daemons" (at the start, or when a node drops off mid-run) and leaves the reader to guess which
host. ``dualframe run`` runs mpirun as a child, passes its output through line by line, and when
that message appears asks the hosts again after mpirun ends, to name the ones that do not answer.
"""
from __future__ import annotations

import signal
import subprocess
import sys
import threading
from typing import BinaryIO, Callable, List, Sequence

#: Open MPI's messages for a daemon it could not start or lost; none of them names the host.
MARKERS = (b"ORTE was unable to reliably start one or more daemons", b"An ORTE daemon has unexpectedly failed")


def _copy(source: BinaryIO, target: BinaryIO, seen: List[bytes]) -> None:
    for line in iter(source.readline, b""):
        target.write(line)
        target.flush()
        seen.extend(marker for marker in MARKERS if marker in line)


def run(command: Sequence[str], env: dict, explain: Callable[[], str]) -> int:
    """Run ``command``, its output passed through; after a daemon failure print ``explain()``.

    Returns:
        The command's exit status (128 + N when signal N ended it), as a shell reports it.
    """
    process = subprocess.Popen(list(command), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    seen: List[bytes] = []
    copiers = [threading.Thread(target=_copy, args=(pipe, out, seen), daemon=True)
               for pipe, out in ((process.stdout, sys.stdout.buffer), (process.stderr, sys.stderr.buffer))]
    for copier in copiers:
        copier.start()
    # A terminal's Ctrl-C already reaches mpirun (same process group): a second one would force its abort.
    previous = {number: signal.signal(number, lambda n, _: process.send_signal(n) if n != signal.SIGINT else None)
                for number in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)}
    try:
        code = process.wait()
        for copier in copiers:
            copier.join()
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)
    if seen:
        print(f"dualframe run: Open MPI could not start or lost a daemon: {explain()}", file=sys.stderr, flush=True)
    return 128 - code if code < 0 else code
