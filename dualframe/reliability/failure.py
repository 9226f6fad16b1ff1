"""Failure handling: a failing or stalled rank names itself and the cause, then ends the whole job.

What the launchers already do (measured with Horovod 0.28.1 and Open MPI 4.1): when a rank exits
non-zero or is killed, ``horovodrun`` and ``mpirun`` terminate the others within seconds, and Horovod
turns a peer's disappearance into ``HorovodInternalError`` on the survivors. What they do not:

* name the failing rank in its own traceback (``mpirun`` prints ranks only for signals and exit codes),
  and end the job promptly when a rank raises inside a thread or Python's shutdown blocks;
* end a *stall*: ranks that wait on collectives the others never call (different tensor names, a
  rank that left the loop early, a point-to-point receive whose sender is gone). Horovod's stall
  inspector can shut down only under its MPI controller; under ``horovodrun --gloo`` it is silent.

:func:`install` adds both: an exception hook that prints ``dualframe: rank R/N (pid P on H) failed:
Type: message`` and exits non-zero at once (the launcher then tears the job down), and a
:class:`Watchdog` that ends the job when one blocking call (a collective, a training step) exceeds
``DUALFRAME_STALL_TIMEOUT`` seconds (default 300; 0 turns it off).
"""
from __future__ import annotations

import contextlib
import faulthandler
import os
import re
import socket
import sys
import threading
import time
import traceback
from types import TracebackType
from typing import Callable, Dict, Iterator, List, Mapping, Optional, Tuple, Type

from dualframe.errors import StrategyError, TopologyError
from dualframe.launch.topology import detect
from dualframe.reliability import lost_rank
from dualframe.reliability.heartbeat import seconds_variable

#: Variable holding the stall timeout in seconds (0 turns the watchdog off).
STALL_VARIABLE = "DUALFRAME_STALL_TIMEOUT"
#: Set to 0 to keep Python's own exception hooks and no watchdog.
HOOKS_VARIABLE = "DUALFRAME_FAILURE_HOOKS"
#: Default stall timeout: generous, since a rank may legitimately wait while rank 0 loads or saves.
DEFAULT_STALL_SECONDS = 300.0
#: Exit status of a rank that dualframe ends.
EXIT_CODE = 1


def rank_label(environ: Optional[Mapping[str, str]] = None) -> str:
    """``"rank 1/2 (pid 4242 on node7)"`` for this process, from the launcher's variables."""
    try:
        topo = detect(environ)
        where = f"rank {topo.rank}/{topo.size}"
    except TopologyError:
        where = "rank ?"
    return f"{where} (pid {os.getpid()} on {socket.gethostname()})"


#: Gloo's words when a peer's connection breaks under a collective (the peer was killed or cut off):
#: ``[.../gloo/transport/tcp/pair.cc:589] Read error [10.0.0.2]:42922: Connection reset by peer``.
_BROKEN_CONNECTION = re.compile(r"gloo/transport/|Connection reset by peer|Connection closed by peer|"
                                r"Broken pipe|Timed out waiting \d+ms for recv")
#: The source location Gloo puts before its message.
_GLOO_LOCATION = re.compile(r"^\[[^\]]*\.(?:cc|h):\d+\]\s*")


def is_broken_connection(error: BaseException) -> bool:
    """True for Horovod's error on a rank whose connection to a peer broke inside a collective (Gloo's words)."""
    return type(error).__name__ in ("HorovodInternalError", "UnknownError", "InternalError") and \
        bool(_BROKEN_CONNECTION.search(str(error)))


def is_peer_failure(error: BaseException) -> bool:
    """True for Horovod's error on the survivors after another rank failed or left.

    Either Horovod shut down (the usual order), or the peer's connection broke under a collective
    before the shutdown reached this rank (a killed peer's socket resets within milliseconds).
    """
    text = str(error)
    # TensorFlow raises it from inside the op, as an UnknownError carrying Horovod's message.
    return (type(error).__name__ == "HorovodInternalError" and "shut down" in text) or \
        "Horovod has been shut down" in text or is_broken_connection(error)


def _first_line(error: BaseException) -> str:
    first_line = (str(error).strip().splitlines() or [""])[0]
    first_line = re.sub(r"^\{\{function_node [^}]*\}\}\s*", "", first_line)  # TensorFlow's op-error prefix
    return _GLOO_LOCATION.sub("", first_line)


def describe(error: BaseException) -> str:
    """One line naming what happened to this rank, for the job's log."""
    if is_broken_connection(error):
        return f"stopped: a connection to another rank broke [{type(error).__name__}: {_first_line(error)}]"
    if is_peer_failure(error):
        return f"stopped: Horovod shut down because another rank failed or left [{type(error).__name__}]"
    return f"failed: {type(error).__name__}: {_first_line(error)}"


def is_lost_peer(error: BaseException) -> bool:
    """True where ``error`` says a peer went: Horovod shut down, or a pipeline's ``PeerLostError``."""
    return is_peer_failure(error) or type(error).__name__ == "PeerLostError"


def end_job(message: str, code: int = EXIT_CODE, how: str = "failed") -> None:
    """Print ``dualframe: <rank label> <message>`` to stderr and exit at once with ``code``.

    The other ranks' heartbeats hear first that this rank ends and ``how`` (failed, stopped).
    ``os._exit`` skips Python's shutdown, which can block on a collective that will never finish;
    the launcher sees the non-zero exit and terminates the other ranks.
    """
    beat = lost_rank.current()
    if beat is not None:
        beat.bye(how, message)
    try:
        sys.stdout.flush()
    except Exception:  # pragma: no cover - a closed stdout must not stop the exit
        pass
    sys.stderr.write(f"dualframe: {rank_label()} {message}\n")
    sys.stderr.flush()
    os._exit(code)


def _excepthook(kind: Type[BaseException], error: BaseException, tb: Optional[TracebackType]) -> None:
    if issubclass(kind, KeyboardInterrupt):
        sys.__excepthook__(kind, error, tb)
        return
    traceback.print_exception(kind, error, tb)
    if is_lost_peer(error):
        stopped = describe(error)
        lost = lost_rank.who_was_lost(str(error), final=lambda guess: end_job(f"{stopped}; {guess}", how="stopped"))
        end_job(f"{stopped}; {lost}", how="stopped")
    end_job(describe(error))


def _thread_excepthook(args: "threading.ExceptHookArgs") -> None:
    if args.exc_type is SystemExit or args.exc_value is None:
        return
    traceback.print_exception(args.exc_type, args.exc_value, args.exc_traceback)
    thread = args.thread.name if args.thread is not None else "?"
    if is_lost_peer(args.exc_value):
        end_job(f"{describe(args.exc_value)} (in thread {thread!r}); {lost_rank.who_was_lost(str(args.exc_value))}",
                how="stopped")
    end_job(f"{describe(args.exc_value)} (in thread {thread!r})")


def stall_timeout(environ: Optional[Mapping[str, str]] = None) -> float:
    """The stall timeout in seconds from ``DUALFRAME_STALL_TIMEOUT`` (default 300, 0 = off).

    Raises:
        StrategyError: the variable is not a number >= 0.
    """
    return seconds_variable(STALL_VARIABLE, DEFAULT_STALL_SECONDS, environ)


class Watchdog:
    """Ends the job when one blocking call lasts longer than ``timeout`` seconds.

    Each thread arms a deadline before a call that waits on other ranks and disarms it after; one
    daemon thread checks the deadlines about once a second. A stall prints what was waited on and
    every thread's stack, then ends the job (``end_job``).

    Example:
        >>> watchdog = Watchdog(timeout=60)
        >>> with watchdog.guard("allreduce 'loss'"):
        ...     pass  # the collective
        >>> watchdog.active()
        {}

    Args:
        timeout: seconds; 0 turns the watchdog off (``guard`` then costs one comparison).
    """

    def __init__(self, timeout: float) -> None:
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout >= 0:
            raise StrategyError(f"timeout must be a number of seconds >= 0 (timeout: {timeout!r})")
        self.timeout = float(timeout)
        self._deadlines: Dict[int, Tuple[float, str]] = {}
        self._thread: Optional[threading.Thread] = None
        self._lock = threading.Lock()

    def arm(self, what: str) -> None:
        """Start the clock for this thread's blocking call ``what``."""
        if self.timeout > 0:
            self._deadlines[threading.get_ident()] = (time.monotonic() + self.timeout, what)
            self._ensure_thread()

    def disarm(self) -> None:
        """This thread's blocking call finished."""
        self._deadlines.pop(threading.get_ident(), None)

    @contextlib.contextmanager
    def guard(self, what: str) -> Iterator[None]:
        """Arm for the body of the ``with`` block; inside another guard, the outer deadline comes back after."""
        outer = self._deadlines.get(threading.get_ident())
        self.arm(what)
        try:
            yield
        finally:
            if outer is None:
                self.disarm()
            else:
                self._deadlines[threading.get_ident()] = outer

    def active(self) -> Dict[int, Tuple[float, str]]:
        """Armed deadlines by thread id (a copy)."""
        return dict(self._deadlines)

    def expired(self, now: Optional[float] = None) -> Optional[str]:
        """What has waited past the timeout, or None."""
        now = time.monotonic() if now is None else now
        for deadline, what in list(self._deadlines.values()):
            if now > deadline:
                return what
        return None

    def _ensure_thread(self) -> None:
        if self._thread is None:
            with self._lock:
                if self._thread is None:
                    self._thread = threading.Thread(target=self._watch, name="dualframe-watchdog", daemon=True)
                    self._thread.start()

    def _watch(self) -> None:
        while True:
            time.sleep(min(1.0, self.timeout / 4))
            what = self.expired()
            if what is not None:
                faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
                lost = lost_rank.lost_now()
                end_job(
                    f"stalled: {what} waited more than {self.timeout:g} s for the other ranks "
                    f"({STALL_VARIABLE}={self.timeout:g}); "
                    + (f"{lost}. Ending the job." if lost else
                       "ranks may call collectives with different names or in a different order, or a rank "
                       "stopped calling them. Ending the job."), how="stopped")


_installed: Dict[str, Watchdog] = {}
_hooked: List[bool] = []  # non-empty once the exception hooks are installed


def install(threads: bool = True, environ: Optional[Mapping[str, str]] = None) -> Watchdog:
    """Install the exception hooks and return the process's Watchdog (idempotent).

    Only under a launcher (more than one rank) and unless ``DUALFRAME_FAILURE_HOOKS=0``: a single
    process has no peer to hang on. Call it before ``hvd.init()``: it also sets Horovod's own stall shutdown
    (``HOROVOD_STALL_CHECK_TIME_SECONDS``, ``HOROVOD_STALL_SHUTDOWN_TIME_SECONDS``) when unset, which
    acts under the MPI controller. Importing ``dualframe.torch`` or ``dualframe.tensorflow`` calls it.

    Args:
        threads: also end the job when a thread other than the main one raises.
        environ: variables to read the timeout from; ``os.environ`` by default.
    """
    if "watchdog" in _installed:
        return _installed["watchdog"]
    env = os.environ if environ is None else environ
    try:
        alone = detect(env).size <= 1
    except TopologyError:
        alone = False  # malformed launcher variables: still protect the job
    if alone or env.get(HOOKS_VARIABLE, "1") == "0":
        _installed["watchdog"] = Watchdog(0)  # one process cannot hang on a peer
        return _installed["watchdog"]
    timeout = stall_timeout(env)
    _hooked.append(True)
    sys.excepthook = _excepthook
    if threads:
        threading.excepthook = _thread_excepthook
    if timeout > 0:
        os.environ.setdefault("HOROVOD_STALL_CHECK_TIME_SECONDS", str(max(1, int(min(60.0, timeout / 2)))))
        os.environ.setdefault("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", str(max(2, int(timeout))))
    _installed["watchdog"] = Watchdog(timeout)
    return _installed["watchdog"]


def watch_peers(gather: Callable[[bytes, str], List[bytes]], rank: int) -> None:
    """Gather every rank's (rank, host, addresses, pid) and start the heartbeat (``lost_rank.watch``).

    Called by ``hvd.init()`` on every rank of a job of more than one process (one allgather); the
    heartbeat runs where the failure hooks are installed. Its notices are printed as
    ``dualframe: <rank label> lost rank 1 (host node2, pid 4242): no heartbeat for 15.0 s``.
    """
    def write(line: str) -> None:
        sys.stderr.write(f"dualframe: {rank_label()} {line}\n")
        sys.stderr.flush()

    lost_rank.watch(gather, rank, write, on=bool(_hooked))


def watchdog() -> Watchdog:
    """The Watchdog ``install`` made (installing now if needed)."""
    return install()
