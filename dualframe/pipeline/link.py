"""The wire between neighbouring pipeline stages, framework-neutral: message names, order, shape headers, bounded waits.

Both adapters move a stage's activations and gradients the same way: a Horovod broadcast from the
sender inside the process set {sender, receiver}, or, when the adapter hands in a ``PointToPoint``,
a direct send and receive: MPI's own when the job runs on MPI (mpirun, srun, horovodrun without
--gloo), ZeroMQ's under ``horovodrun --gloo``, where there is no MPI world (``dualframe.pipeline.direct``
chooses). A Horovod broadcast works under every launcher, but each one waits for Horovod's background
thread to agree on it with the peer's, a few milliseconds on a busy node; a direct message goes
from the sender's to the receiver's main thread. Sends return at once; receives
whose shape is known are posted ahead, so transfers overlap the stage's compute. A receiver learns
a forward message's shape from a small header the first time a step with that input shape runs;
afterwards both sides know it. Every wait is bounded: a neighbour that died or hangs becomes a
``PeerLostError`` naming it, instead of a silent hang.

This module owns that bookkeeping (``StageLink``) and the bounded wait (``wait_for``); the
framework hands in the few tensor and Horovod calls it needs (a ``Wire``, declared with ``Waiter``
and ``PointToPoint`` in ``dualframe.backend``).
"""
from __future__ import annotations

import os
from typing import Any, Dict, Generic, List, Mapping, Optional, Sequence, Tuple, TypeVar

from dualframe.backend import PointToPoint, Shape, Waiter, Wire
from dualframe.errors import StrategyError
from dualframe.pipeline.layout import DTYPE_NAMES, MAX_DIMS, PeerLostError

T = TypeVar("T")

#: A forward message's header: [ndim, dims x MAX_DIMS, dtype code].
HEADER_LENGTH = MAX_DIMS + 2
INT64 = DTYPE_NAMES.index("int64")


#: Message numbers per micro-batch: its activation, its gradient, its activation's shape header.
_KINDS = {"F": 0, "B": 1, "H": 2}


def message_tag(tag: str, header: bool = False) -> int:
    """The point-to-point number of message ``tag`` (``"F3"``, ``"B3"``), or of its shape header.

    Numbers repeat every step: a step's messages are all received within that step.

    Example:
        >>> message_tag("F0"), message_tag("B0"), message_tag("F0", header=True), message_tag("F2")
        (0, 1, 2, 6)
    """
    return len(_KINDS) * int(tag[1:]) + _KINDS["H" if header else tag[0]]


#: A step's control messages, numbered after its micro-batches' (see ``control_tag``).
_CONTROL = ("agree", "loss")


def control_tag(name: str, chunks: int) -> int:
    """The point-to-point number of a step's control message ``name``: "agree" (the step agreement) or "loss".

    Numbered after every ``message_tag`` of ``chunks`` micro-batches, so that no message takes another's.

    Example:
        >>> control_tag("agree", 4), control_tag("loss", 4), message_tag("F3", header=True)
        (12, 13, 11)
    """
    return len(_KINDS) * chunks + _CONTROL.index(name)


def largest_tag(chunks: int, links: int = 1) -> int:
    """The highest point-to-point number of a step of ``chunks`` micro-batches (MPI's tag bound must reach it).

    ``links``: how many stage boundaries number their messages apart (``virtual_tag_offset``).

    Example:
        >>> largest_tag(4), largest_tag(4, links=3), virtual_tag_offset(2, 4)
        (13, 41, 28)
    """
    return control_tag(_CONTROL[-1], chunks) + (links - 1) * (control_tag(_CONTROL[-1], chunks) + 1)


def virtual_tag_offset(boundary: int, chunks: int) -> int:
    """What the link between stage ``boundary`` and ``boundary + 1`` adds to its point-to-point numbers.

    With virtual stages one pair of ranks carries several boundaries' messages (interleaved 1F1B's
    stages 0 -> 1 and 2 -> 3 both go from rank 0 to rank 1): each boundary numbers them in its own
    block, the size of a whole step's numbers, so no boundary's message matches another's receive.
    """
    return boundary * (control_tag(_CONTROL[-1], chunks) + 1)


#: How pipeline messages travel: "auto" (the first point-to-point transport every rank has, else Horovod
#: broadcasts), "mpi" (MPI point-to-point or an error), "zmq" (ZeroMQ point-to-point or an error) or
#: "horovod" (Horovod broadcasts).
TRANSPORT_VARIABLE = "DUALFRAME_PIPELINE_TRANSPORT"
TRANSPORTS = ("auto", "mpi", "zmq", "horovod")
#: The point-to-point transports, in the order "auto" prefers them, and how to get each one.
DIRECT_TRANSPORTS = ("mpi", "zmq")
_REMEDY = {"mpi": "launch with mpirun or srun", "zmq": "install pyzmq on every host"}


def check_transport(transport: Optional[str]) -> Optional[str]:
    """A pipeline's ``transport=`` argument, checked and lower-cased; None (the default) leaves it to the variable.

    Example:
        >>> check_transport(" ZMQ "), check_transport(None)
        ('zmq', None)

    Raises:
        StrategyError: a value other than auto, mpi, zmq, horovod or None.
    """
    if transport is None:
        return None
    value = transport.strip().lower() if isinstance(transport, str) else transport
    if value not in TRANSPORTS:
        raise StrategyError(f"transport must be one of {', '.join(TRANSPORTS)}, or None to read {TRANSPORT_VARIABLE} "
                            f"(transport: {transport!r})")
    return value


def transport_choice(environ: Optional[Mapping[str, str]] = None, transport: Optional[str] = None) -> str:
    """The transport asked for: ``transport`` (the pipeline's argument) when given, else ``DUALFRAME_PIPELINE_TRANSPORT`` ("auto" when unset).

    Example:
        >>> transport_choice({TRANSPORT_VARIABLE: "horovod"}), transport_choice({TRANSPORT_VARIABLE: "horovod"}, "zmq")
        ('horovod', 'zmq')

    Raises:
        StrategyError: a value other than auto, mpi, zmq or horovod.
    """
    if transport is not None:
        return str(check_transport(transport))
    value = (os.environ if environ is None else environ).get(TRANSPORT_VARIABLE, "auto").strip().lower() or "auto"
    if value not in TRANSPORTS:
        raise StrategyError(f"{TRANSPORT_VARIABLE} must be one of {', '.join(TRANSPORTS)} ({TRANSPORT_VARIABLE}: {value!r})")
    return value


def transport_votes(choice: str, missing: Mapping[str, Optional[str]]) -> List[int]:
    """This rank's share of the transport agreement, summed over every rank: [has mpi, has zmq, choice].

    Args:
        choice: ``transport_choice()`` on this rank.
        missing: why this rank cannot use each of ``DIRECT_TRANSPORTS`` (None, or left out, when it can).

    Example:
        >>> transport_votes("auto", {"mpi": "Horovod runs on Gloo", "zmq": None})
        [0, 1, 0]
    """
    return [int(missing.get(name) is None) for name in DIRECT_TRANSPORTS] + [TRANSPORTS.index(choice)]


def agree_transport(sums: Sequence[int], ranks: int, choice: str, missing: Mapping[str, Optional[str]],
                    asked_by: str = TRANSPORT_VARIABLE) -> str:
    """The transport the pipeline's messages take ("mpi", "zmq" or "horovod"), from the summed ``transport_votes``.

    Every rank gets the same sums, so every rank decides alike or raises alike: "auto" takes the
    first of ``DIRECT_TRANSPORTS`` that every rank has, else "horovod".

    Example:
        >>> agree_transport([2, 2, 0], 2, "auto", {}), agree_transport([0, 2, 0], 2, "auto", {})
        ('mpi', 'zmq')
        >>> agree_transport([1, 1, 0], 2, "auto", {})
        'horovod'

    Raises:
        StrategyError: the ranks asked for different transports, or "mpi" / "zmq" where a rank lacks it;
        the message names ``asked_by`` (``"transport"``: the pipeline's argument; else the variable).
    """
    available, choices = [int(s) for s in sums[:len(DIRECT_TRANSPORTS)]], int(sums[len(DIRECT_TRANSPORTS)])
    if choices != TRANSPORTS.index(choice) * ranks:
        raise StrategyError(f"every rank must ask for the same transport (this rank: {choice!r}, by {asked_by}); "
                            f"pass the same transport= on every rank, or set {TRANSPORT_VARIABLE} on all of them "
                            f"(e.g. mpirun -x {TRANSPORT_VARIABLE})")
    if choice in DIRECT_TRANSPORTS:
        lacking = ranks - available[DIRECT_TRANSPORTS.index(choice)]
        if lacking:
            raise StrategyError(f"{asked_by}={choice} needs {choice} point-to-point on every rank "
                                f"({lacking} of {ranks} lack it; here: {missing.get(choice) or 'available'}); "
                                f"{_REMEDY[choice]}, or use auto")
        return choice
    if choice == "auto":
        for name, count in zip(DIRECT_TRANSPORTS, available):
            if count == ranks:
                return name
    return "horovod"


def wait_for(wire: "Waiter[T]", handle: Any, what: str, timeout: float) -> T:
    """The result of ``handle``, waiting at most ``timeout`` s; PeerLostError on silence or when Horovod stopped.

    Example:
        >>> wait_for(wire, wire.broadcast(x, 0, "x", ps), "waiting for x", 45.0)   # doctest: +SKIP
    """
    try:
        if wire.done(handle, timeout):
            return wire.result(handle)
    except PeerLostError as error:  # a point-to-point transport saw the peer go: say what waited
        raise PeerLostError(f"{what}: {error}") from error
    except Exception as error:
        reason = wire.stopped(error)
        if reason is None:
            raise
        raise PeerLostError(f"{what}: Horovod stopped ({reason}); a neighbouring stage failed or exited") from error
    raise PeerLostError(
        f"{what}: nothing arrived within {timeout:g} s; that stage died or hangs "
        f"(raise timeout= if a step legitimately takes longer)"
    )


def encode_header(shape: Shape) -> List[int]:
    """``[ndim, dims..., 0 ..., dtype code]`` of a forward message; StrategyError over MAX_DIMS dimensions."""
    dims, code = shape
    if len(dims) > MAX_DIMS:
        raise StrategyError(f"a stage's output may have at most {MAX_DIMS} dimensions (output shape: {dims})")
    return [len(dims), *dims] + [0] * (MAX_DIMS - len(dims)) + [code]


def decode_header(header: Sequence[Any]) -> Shape:
    """The (dims, dtype code) an ``encode_header`` list carries."""
    ndim = int(header[0])
    return tuple(int(d) for d in header[1:1 + ndim]), int(header[-1])


class StageLink(Generic[T]):
    """Stage j's links to stage j - 1 and j + 1 of its pipeline (the core's StageLinks).

    Args:
        wire: the framework's calls.
        stage: j; ``ranks``: the pipeline's ranks in stage order; ``rank``: this process's.
        sets: Horovod process sets by their sorted ranks (must hold every neighbouring pair).
        prefix: the pipeline's name in its messages.
        timeout: seconds a wait may last.
        step_names: whether message names carry the step number (TensorFlow traces one function
            per name, so its names repeat every step, which Horovod allows once the previous op of
            that name finished; torch names every step's messages anew).
        direct: point-to-point (MPI or ZeroMQ) between the pipeline's ranks; None moves messages as Horovod broadcasts.
        tag_offset: added to every point-to-point number (``message_tag``) of this link, so that several
            links between the same two ranks (``virtual_tag_offset``) never take each other's messages.

    Example:
        >>> link = StageLink(wire, 0, [0, 1], 0, sets, "dpipe0", timeout=45.0)   # doctest: +SKIP
        >>> link.begin(key=((64, 16), 0), backward=True, chunks=4)               # doctest: +SKIP
        >>> link.send("F0", activation); grad = link.receive("B0")                # doctest: +SKIP
    """

    def __init__(self, wire: "Wire[T]", stage: int, ranks: Sequence[int], rank: int,
                 sets: Dict[Tuple[int, ...], Any], prefix: str, timeout: float, step_names: bool = True,
                 direct: "Optional[PointToPoint[T]]" = None, tag_offset: int = 0) -> None:
        self.wire, self.stage, self.ranks, self.rank, self.direct = wire, stage, list(ranks), rank, direct
        self.tag_offset = tag_offset  # several links between one pair of ranks (virtual stages) number apart
        self.prefix, self.timeout, self.step_names = prefix, timeout, step_names
        j = stage
        self.prev = (ranks[j - 1], sets[tuple(sorted((ranks[j - 1], ranks[j])))]) if j > 0 else None
        self.next = (ranks[j + 1], sets[tuple(sorted((ranks[j], ranks[j + 1])))]) if j < len(ranks) - 1 else None
        self._shapes: Dict[Tuple[Any, str], Shape] = {}
        self._posted: Dict[str, Tuple[Any, str, Waiter[T]]] = {}  # tag -> (handle, name, what waits on it)
        self._sends: List[Tuple[Any, str, Waiter[T]]] = []
        self._step, self._key, self._backward = 0, None, False

    @property
    def step(self) -> int:
        """How many steps this link finished (the current step's number)."""
        return self._step

    def name(self, tag: str) -> str:
        """The Horovod name of ``tag`` (a message, ``"agree"``, ``"loss"``) in the current step."""
        return f"{self.prefix}.{self._step}.{tag}" if self.step_names else f"{self.prefix}.{tag}"

    def begin(self, key: Any, backward: bool, chunks: int) -> None:
        """Start a step with input ``key`` (shape, dtype): post the forward receives earlier steps taught us."""
        self._key, self._backward = key, backward
        for i in range(chunks):
            if self.prev is not None and (key, f"F{i}") in self._shapes:
                self._post(f"F{i}", self._shapes[(key, f"F{i}")])

    def _message(self, tag: str, sender: int, receiver: int) -> str:
        return self.name(f"{tag}.{sender}_to_{receiver}")

    def _peer(self, tag: str, sending: bool) -> Tuple[int, Any]:
        forward = tag[0] == "F"
        peer = self.next if forward == sending else self.prev
        assert peer is not None, f"stage {self.stage} has no neighbour for {tag}"
        return peer

    def _post(self, tag: str, shape: Shape) -> None:
        root, ps = self._peer(tag, sending=False)
        name = self._message(tag, root, self.rank)
        buffer = self.wire.empty(*shape)
        if self.direct is not None:
            number = message_tag(tag) + self.tag_offset
            self._posted[tag] = (self.direct.receive(buffer, root, number), name, self.direct)
        else:
            self._posted[tag] = (self.wire.broadcast(buffer, root, name, ps), name, self.wire)

    def receive(self, tag: str) -> T:
        """Wait for ``tag`` from the neighbour (posting the receive now if it was not posted ahead)."""
        if tag not in self._posted:
            if (self._key, tag) not in self._shapes:
                self._shapes[(self._key, tag)] = self._receive_header(tag)
            self._post(tag, self._shapes[(self._key, tag)])
        handle, name, waiter = self._posted.pop(tag)
        root, _ = self._peer(tag, sending=False)
        return self.wait(handle, f"waiting for {tag} from rank {root} ({name})", waiter)

    def _receive_header(self, tag: str) -> Shape:
        root, ps = self._peer(tag, sending=False)
        buffer = self.wire.tensor([0] * HEADER_LENGTH, INT64)
        what = f"waiting for the shape of {tag} from rank {root}"
        if self.direct is not None:
            number = message_tag(tag, header=True) + self.tag_offset
            header = self.wait(self.direct.receive(buffer, root, number), what, self.direct)
        else:
            header = self.wait(self.wire.broadcast(buffer, root, self._message(tag, root, self.rank) + ".shape", ps), what)
        return decode_header(self.wire.values(header))

    def send(self, tag: str, tensor: T) -> None:
        """Start sending ``tensor`` as ``tag``; a forward send also posts the matching gradient's receive."""
        receiver, ps = self._peer(tag, sending=True)
        shape = self.wire.describe(tensor)
        if tag[0] == "F" and (self._key, tag) not in self._shapes:
            header = self.wire.tensor(encode_header(shape), INT64)
            self._start_send(header, receiver, ps, tag, header=True)
            self._shapes[(self._key, tag)] = shape
        self._start_send(tensor, receiver, ps, tag)
        if tag[0] == "F" and self._backward:
            self._post("B" + tag[1:], shape)  # the gradient has the activation's shape

    def _start_send(self, tensor: T, receiver: int, ps: Any, tag: str, header: bool = False) -> None:
        name = self._message(tag, self.rank, receiver) + (".shape" if header else "")
        if self.direct is not None:
            number = message_tag(tag, header) + self.tag_offset
            self._sends.append((self.direct.send(tensor, receiver, number), name, self.direct))
        else:
            self._sends.append((self.wire.broadcast(tensor, self.rank, name, ps), name, self.wire))

    def finish(self) -> None:
        """Wait until every message this step sent has been delivered; later names belong to the next step."""
        sends, self._sends = self._sends, []
        for handle, name, waiter in sends:
            self.wait(handle, f"delivering {name}", waiter)
        self._step += 1

    def wait(self, handle: Any, what: str, waiter: "Optional[Waiter[T]]" = None) -> T:
        """``wait_for`` (on ``waiter``, the wire by default) with this stage and rank named in the error."""
        return wait_for(waiter or self.wire, handle, f"stage {self.stage} (rank {self.rank}) {what}", self.timeout)
