"""Moving activations and gradients between TensorFlow pipeline stages: Horovod broadcasts on 2-rank process sets.

The same wire as ``dualframe.torch.pipeline_transport`` (a broadcast from the sender inside the
process set {sender, receiver}, a shape header the first time a step with a given input shape
runs, the order taken from the schedule data), with two TensorFlow facts worked around:

* Horovod's TF ops in eager mode block the caller and all carry their op type as Horovod's name,
  so two in flight at once collide ("a tensor with the same name ... is being processed"). Each
  message is therefore a small ``tf.function`` named after the message (traced once per name and
  shape), run on its own daemon thread: sends return at once, receives are posted ahead.
* A blocking op cannot be polled, so a wait is ``Event.wait(timeout)`` on that thread: a neighbour
  that died or hangs becomes a ``PeerLostError`` naming it instead of a silent hang.

Names carry no step number: a name comes back only after this rank's previous op of that name
finished (every step waits for its sends), which is all Horovod asks.
"""
from __future__ import annotations

import logging
import threading
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import tensorflow as tf

from dualframe.errors import StrategyError
from dualframe.stage_setup import DTYPE_NAMES, PeerLostError, dtype_code, resolve_process_sets
from dualframe.tensorflow.collectives import hvd

#: dtypes a message may carry, by code (the header's last field); the same codes as torch's.
DTYPES = tuple(tf.as_dtype(name) for name in DTYPE_NAMES)
_HEADER = 10  # ndim, up to 8 dims, dtype code


def tf_dtype_code(dtype: Any) -> int:
    """Code of a TensorFlow dtype in DTYPES; StrategyError for others."""
    return dtype_code(tf.as_dtype(dtype).name)


def process_sets(needed: Sequence[Sequence[int]]) -> Dict[Tuple[int, ...], Any]:
    """Horovod ProcessSets for the rank groups ``needed`` (see ``dualframe.stage_setup.resolve_process_sets``)."""
    from horovod.common import process_sets as registry

    return resolve_process_sets(hvd, registry, needed)


class Pending:
    """One Horovod op running on its own daemon thread; ``result`` waits for it, bounded.

    Example:
        >>> pending = Pending(lambda: 42)
        >>> pending.result("the answer", timeout=5.0)
        42
    """

    def __init__(self, call: Callable[[], Any]) -> None:
        self._done = threading.Event()
        self._value: Any = None
        self._error: Optional[BaseException] = None
        threading.Thread(target=self._run, args=(call,), daemon=True, name="dualframe-pipeline-op").start()

    def _run(self, call: Callable[[], Any]) -> None:
        try:
            self._value = call()
        except BaseException as error:  # handed to the waiting thread, which raises it
            self._error = error
        finally:
            self._done.set()

    def result(self, what: str, timeout: float) -> Any:
        """The op's result; PeerLostError when nothing came within ``timeout`` s or Horovod stopped."""
        if not self._done.wait(timeout):
            raise PeerLostError(
                f"{what}: nothing arrived within {timeout:g} s; that stage died or hangs "
                f"(raise timeout= if a step legitimately takes longer)"
            )
        if isinstance(self._error, tf.errors.OpError):
            first = (self._error.message.strip().splitlines() or [""])[0]
            raise PeerLostError(f"{what}: Horovod stopped ({first}); a neighbouring stage failed or exited") from self._error
        if self._error is not None:
            raise self._error
        return self._value


_FUNCTIONS: Dict[Tuple[str, str, int, int], Callable[..., Any]] = {}


class _QuietTracing(logging.Filter):
    """Drops TensorFlow's "frequent retracing" warning about our message functions: one trace per name is the design."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "_named.<locals>.run" not in record.getMessage()


tf.get_logger().addFilter(_QuietTracing())


def _named(kind: str, name: str, root_or_op: int, process_set: Any) -> Callable[..., Any]:
    """A tf.function running one Horovod op under Horovod's name ``name`` (made once per name)."""
    key = (kind, name, int(root_or_op), int(process_set.process_set_id))
    if key not in _FUNCTIONS:
        if kind == "broadcast":
            def run(tensor: Any) -> Any:
                return hvd.broadcast(tensor, root_or_op, name=name, ignore_name_scope=True, process_set=process_set)
        else:
            def run(tensor: Any) -> Any:
                return hvd.allreduce(tensor, op=root_or_op, name=name, ignore_name_scope=True,
                                     process_set=process_set)
        _FUNCTIONS[key] = tf.function(run, autograph=False, reduce_retracing=True)
    return _FUNCTIONS[key]


def broadcast(tensor: Any, root_rank: int, name: str, process_set: Any) -> Pending:
    """Start a named broadcast from ``root_rank`` in ``process_set`` (returns at once)."""
    run = _named("broadcast", name, root_rank, process_set)
    return Pending(lambda: run(tensor))


def allreduce(tensor: Any, op: Any, name: str, process_set: Any) -> Pending:
    """Start a named allreduce with Horovod's ``op`` in ``process_set`` (returns at once)."""
    run = _named("allreduce", name, op, process_set)
    return Pending(lambda: run(tensor))


class TFHorovodLinks:
    """Stage j's links to stage j - 1 and j + 1 of its pipeline (the core's StageLinks), in TensorFlow.

    Example:
        >>> links = TFHorovodLinks(0, [0, 1], sets, "dpipe0", timeout=45.0)   # doctest: +SKIP
        >>> links.begin(key=((64, 16), 0), backward=True, chunks=4)           # doctest: +SKIP
        >>> links.send("F0", activation); grad = links.receive("B0")           # doctest: +SKIP
    """

    def __init__(self, stage: int, ranks: Sequence[int], sets: Dict[Tuple[int, ...], Any], prefix: str,
                 timeout: float) -> None:
        self.stage, self.ranks, self.prefix, self.timeout = stage, list(ranks), prefix, timeout
        j = stage
        self.prev = (ranks[j - 1], sets[tuple(sorted((ranks[j - 1], ranks[j])))]) if j > 0 else None
        self.next = (ranks[j + 1], sets[tuple(sorted((ranks[j], ranks[j + 1])))]) if j < len(ranks) - 1 else None
        self.rank = int(hvd.rank())
        self._shapes: Dict[Tuple[Any, str], Tuple[Tuple[int, ...], Any]] = {}
        self._posted: Dict[str, Tuple[Pending, str]] = {}
        self._sends: List[Tuple[Pending, str]] = []
        self._key: Any = None
        self._backward = False

    def begin(self, key: Any, backward: bool, chunks: int) -> None:
        """Start a step: post the forward receives whose shapes earlier steps taught us."""
        self._key, self._backward = key, backward
        for i in range(chunks):
            if self.prev is not None and (key, f"F{i}") in self._shapes:
                self._post(f"F{i}", *self._shapes[(key, f"F{i}")])

    def _name(self, tag: str, sender: int, receiver: int) -> str:
        return f"{self.prefix}.{tag}.{sender}_to_{receiver}"

    def _peer(self, tag: str, sending: bool) -> Tuple[int, Any]:
        forward = tag[0] == "F"
        peer = self.next if forward == sending else self.prev
        assert peer is not None, f"stage {self.stage} has no neighbour for {tag}"
        return peer

    def _post(self, tag: str, shape: Tuple[int, ...], dtype: Any) -> None:
        root, ps = self._peer(tag, sending=False)
        name = self._name(tag, root, self.rank)
        self._posted[tag] = (broadcast(tf.zeros(shape, dtype), root, name, ps), name)

    def receive(self, tag: str) -> tf.Tensor:
        """Wait for ``tag`` from the neighbour (posting the receive now if it was not posted ahead)."""
        if tag not in self._posted:
            if (self._key, tag) not in self._shapes:
                self._shapes[(self._key, tag)] = self._receive_header(tag)
            self._post(tag, *self._shapes[(self._key, tag)])
        pending, name = self._posted.pop(tag)
        root, _ = self._peer(tag, sending=False)
        return pending.result(f"stage {self.stage} (rank {self.rank}) waiting for {tag} from rank {root} ({name})",
                              self.timeout)

    def _receive_header(self, tag: str) -> Tuple[Tuple[int, ...], Any]:
        root, ps = self._peer(tag, sending=False)
        pending = broadcast(tf.zeros([_HEADER], tf.int64), root, self._name(tag, root, self.rank) + ".shape", ps)
        header = pending.result(f"stage {self.stage} (rank {self.rank}) waiting for the shape of {tag} from rank {root}",
                                self.timeout).numpy()
        ndim = int(header[0])
        return tuple(int(d) for d in header[1:1 + ndim]), DTYPES[int(header[-1])]

    def send(self, tag: str, tensor: tf.Tensor) -> None:
        """Start sending ``tensor`` as ``tag``; a forward send also posts the matching gradient's receive."""
        receiver, ps = self._peer(tag, sending=True)
        shape = (tuple(int(d) for d in tensor.shape), tensor.dtype)
        if tag[0] == "F" and (self._key, tag) not in self._shapes:
            if len(shape[0]) > _HEADER - 2:
                raise StrategyError(f"a stage's output may have at most {_HEADER - 2} dimensions (output shape: {shape[0]})")
            header = [len(shape[0]), *shape[0]] + [0] * (_HEADER - 2 - len(shape[0])) + [tf_dtype_code(tensor.dtype)]
            name = self._name(tag, self.rank, receiver) + ".shape"
            self._sends.append((broadcast(tf.constant(header, tf.int64), self.rank, name, ps), name))
            self._shapes[(self._key, tag)] = shape
        name = self._name(tag, self.rank, receiver)
        self._sends.append((broadcast(tensor, self.rank, name, ps), name))
        if tag[0] == "F" and self._backward:
            self._post("B" + tag[1:], *shape)  # the gradient has the activation's shape

    def finish(self) -> None:
        """Wait until every message this step sent has been delivered."""
        sends, self._sends = self._sends, []
        for pending, name in sends:
            pending.result(f"stage {self.stage} (rank {self.rank}) delivering {name}", self.timeout)
