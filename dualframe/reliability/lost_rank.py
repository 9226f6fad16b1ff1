"""What a surviving rank says about a lost one: its heartbeat's findings, else what the error names, else the only other rank.

``watch`` runs at ``hvd.init()`` (``dualframe.collectives``): one allgather of every rank's ``Peer``
and the heartbeat (``dualframe.reliability.heartbeat``). ``who_was_lost`` is what the failure hooks
append to a survivor's last line: ``lost rank 1 (host node2, pid 4242): no heartbeat for 30.1 s``.
"""
from __future__ import annotations

import os
import signal
import threading
import time
from types import FrameType
from typing import Any, Callable, Dict, List, Optional

from dualframe.reliability import heartbeat as _heartbeat
from dualframe.reliability.heartbeat import Heartbeat
from dualframe.reliability.peers import PeerTable

#: Seconds of silence that count as evidence once an error said a peer went (three beats missed).
EVIDENCE_S = 3 * _heartbeat.INTERVAL_S
#: Longest wait for that evidence before the last line is written.
WAIT_S = 2.0
_state: Dict[str, Any] = {}


def watch(gather: Callable[[bytes, str], List[bytes]], rank: int, write: Callable[[str], None], on: bool) -> None:
    """Gather the job's PeerTable and start the heartbeat (``heartbeat.start``); every rank calls it once.

    Where the heartbeat runs, a SIGTERM (the launcher ending the job after a rank died) first makes this
    rank write what it knows of a lost rank, then exit with status 143 (``watch_sigterm``).
    """
    table, beat = _heartbeat.start(gather, rank, write, on)
    _state.update(table=table, heartbeat=beat, write=write)
    if beat is not None:
        watch_sigterm()


def watch_sigterm() -> bool:
    """On SIGTERM, name the lost rank (if the heartbeat knows one) and exit 143; False where it cannot be set.

    Python runs a signal handler only when the main thread returns to the interpreter, never while
    it waits inside Horovod's C++ for a lost peer; so the handler is also reached through
    ``signal.set_wakeup_fd`` by a thread of its own. Only where SIGTERM has its default action (it
    ends the process: so does this), no wakeup fd is set yet (asyncio sets one), and from the main
    thread; a handler the script sets later wins.
    """
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return False
    read, write = os.pipe()
    os.set_blocking(write, False)
    previous = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
    if previous != -1:
        signal.set_wakeup_fd(previous)  # someone else's (asyncio's): give it back, leave SIGTERM alone
        os.close(read)
        os.close(write)
        return False
    signal.signal(signal.SIGTERM, _on_sigterm_signal)
    threading.Thread(target=_read_signals, args=(read,), name="dualframe-sigterm", daemon=True).start()
    return True


def _on_sigterm_signal(signum: int, frame: Optional[FrameType]) -> None:
    _terminated()


def _read_signals(fd: int) -> None:
    while True:
        data = os.read(fd, 64)
        if not data:
            return
        if signal.SIGTERM in data and signal.getsignal(signal.SIGTERM) is _on_sigterm_signal:
            _terminated()


_ending = threading.Lock()


def _terminated() -> None:
    if not _ending.acquire(blocking=False):
        return  # the other path (main thread or the signal thread) is already ending the process
    beat, write = current(), _state.get("write")
    if beat is not None:
        _poke(beat)
        found = lost_now()
        beat.bye("stopped", "ended by SIGTERM")
        if found and write is not None:
            write(f"ended by SIGTERM (the launcher or the scheduler ends the job); {found}")
    os._exit(128 + signal.SIGTERM)


def current() -> Optional[Heartbeat]:
    """This process's running Heartbeat, if any."""
    beat = _state.get("heartbeat")
    return beat if isinstance(beat, Heartbeat) else None


def table() -> Optional[PeerTable]:
    """The job's PeerTable once ``watch`` ran."""
    found = _state.get("table")
    return found if isinstance(found, PeerTable) else None


def lost_now(text: str = "") -> str:
    """``lost rank 1 (host b, pid 22): why`` from the heartbeat, else from what ``text`` names; "" when neither knows."""
    beat, peers = current(), table()
    if beat is not None:
        found = beat.lost(EVIDENCE_S)
        if found:
            return beat.describe(found)
    named = peers.named_in(text) if peers is not None and text else []
    if peers is not None and named:
        return f"lost {peers.describe(named)} (named by the error)"
    return ""


def who_was_lost(text: str, final: Optional[Callable[[str], None]] = None) -> str:
    """What this survivor's last line says about the lost rank, waiting up to ``WAIT_S`` for the heartbeat's evidence.

    Args:
        text: the error's text (Gloo's, MPI's, a pipeline's), searched for a rank, host or address.
        final: called with the best answer so far if the launcher sends SIGTERM during the wait
            (main thread only); it must end the process.
    """
    beat = current()
    if beat is not None:
        previous = _on_sigterm(final)
        try:
            deadline = time.monotonic() + WAIT_S
            while not lost_now(text) and not beat.ended() and time.monotonic() < deadline:
                beat.send_all()  # a closed port answers the next send with a refusal
                time.sleep(0.05)
        finally:
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)
    return lost_now(text) or _fallback(beat)


def _poke(beat: Optional[Heartbeat]) -> None:
    """Beat three times in 0.2 s: a killed peer's closed port answers the next send with a refusal."""
    if beat is None:
        return
    for _ in range(3):
        beat.send_all()
        time.sleep(0.07)


def _fallback(beat: Optional[Heartbeat]) -> str:
    peers = table()
    if beat is not None and beat.ended():
        return "; ".join(f"{peers.peers[r].label()}: {how}" for r, how in beat.ended()) if peers else ""
    if peers is not None and peers.size == 2:
        other = peers.others()[0]
        heard = beat.heard.get(other) if beat is not None else None
        last = f"; its last heartbeat {time.monotonic() - heard:.1f} s ago" if heard is not None else ""
        return f"lost {peers.describe([other])} (the only other rank{last})"
    if peers is not None and beat is not None:
        return f"no rank is known lost yet (every other rank's heartbeat answered within {EVIDENCE_S:g} s)"
    return "(its own 'dualframe: rank ... failed' line names the rank that failed)"


def _on_sigterm(final: Optional[Callable[[str], None]]) -> Any:
    if final is None:
        return None
    try:
        def handler(signum: int, frame: Optional[FrameType]) -> None:
            _poke(current())
            final(lost_now() or _fallback(current()))

        return signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread
        return None
