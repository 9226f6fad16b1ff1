"""Moving activations and gradients between pipeline stages: Horovod broadcasts on 2-rank process sets.

Why broadcasts and not mpi4py send/recv: under ``horovodrun --gloo`` there is no MPI world (mpi4py's
COMM_WORLD is a single process), while a Horovod broadcast from the sender inside the process set
{sender, receiver} works under horovodrun, mpirun and srun alike. Operations are asynchronous:
a send returns at once, receives whose shape is known are posted ahead, so transfers overlap the
stage's compute. A receiver learns a forward message's shape from a small header the first time a
step with that input shape runs; afterwards both sides know it. Every wait is bounded: a neighbour
that died or hangs turns into a ``PeerLostError`` naming it, instead of a silent hang.
"""
from __future__ import annotations

import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from dualframe.errors import StrategyError
from dualframe.stage_setup import PeerLostError, resolve_process_sets
from dualframe.torch.collectives import hvd

__all__ = ["DTYPES", "HorovodLinks", "PeerLostError", "dtype_code", "process_sets", "wait"]

#: dtypes a message may carry, by code (the header's last field).
DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.uint8, torch.bool)
_HEADER = 10  # ndim, up to 8 dims, dtype code


def dtype_code(dtype: torch.dtype) -> int:
    """Index of ``dtype`` in DTYPES; StrategyError for others."""
    if dtype not in DTYPES:
        raise StrategyError(f"pipeline messages must have one of the dtypes {[str(d) for d in DTYPES]} (dtype: {dtype})")
    return DTYPES.index(dtype)


def process_sets(needed: Sequence[Sequence[int]]) -> Dict[Tuple[int, ...], Any]:
    """Horovod ProcessSets for the rank groups ``needed`` (see ``dualframe.stage_setup.resolve_process_sets``)."""
    from horovod.common import process_sets as registry

    return resolve_process_sets(hvd, registry, needed)


def wait(handle: Any, what: str, timeout: float) -> Any:
    """Horovod's ``synchronize(handle)``, bounded by ``timeout`` seconds; PeerLostError on silence or shutdown."""
    deadline = time.monotonic() + timeout
    pause = 0.0
    try:
        while not hvd.poll(handle):
            if time.monotonic() > deadline:
                raise PeerLostError(
                    f"{what}: nothing arrived within {timeout:g} s; that stage died or hangs "
                    f"(raise timeout= if a step legitimately takes longer)"
                )
            time.sleep(pause)
            pause = min(0.002, pause + 0.0001)
        return hvd.synchronize(handle)
    except hvd.HorovodInternalError as error:
        raise PeerLostError(f"{what}: Horovod stopped ({error}); a neighbouring stage failed or exited") from error


class HorovodLinks:
    """Stage j's links to stage j - 1 and j + 1 of its pipeline (the core's StageLinks).

    Example:
        >>> links = HorovodLinks(0, [0, 1], sets, "dp0", timeout=45.0)   # doctest: +SKIP
        >>> links.begin("s3", key=((64, 16), 0), backward=True)        # doctest: +SKIP
        >>> links.send("F0", activation); grad = links.receive("B0")    # doctest: +SKIP
    """

    def __init__(self, stage: int, ranks: Sequence[int], sets: Dict[Tuple[int, ...], Any], prefix: str,
                 timeout: float, device: torch.device = torch.device("cpu")) -> None:
        self.stage, self.ranks, self.prefix, self.timeout, self.device = stage, list(ranks), prefix, timeout, device
        j = stage
        self.prev = (ranks[j - 1], sets[tuple(sorted((ranks[j - 1], ranks[j])))]) if j > 0 else None
        self.next = (ranks[j + 1], sets[tuple(sorted((ranks[j], ranks[j + 1])))]) if j < len(ranks) - 1 else None
        self._shapes: Dict[Tuple[Any, str], Tuple[Tuple[int, ...], torch.dtype]] = {}
        self._posted: Dict[str, Tuple[Any, str]] = {}
        self._sends: List[Tuple[Any, str]] = []
        self._step, self._key, self._backward = "", None, False

    def begin(self, step: str, key: Any, backward: bool, chunks: int) -> None:
        """Start a step: post the forward receives whose shapes earlier steps taught us."""
        self._step, self._key, self._backward = step, key, backward
        for i in range(chunks):
            if self.prev is not None and (key, f"F{i}") in self._shapes:
                self._post(f"F{i}", *self._shapes[(key, f"F{i}")])

    def _name(self, tag: str, sender: int, receiver: int) -> str:
        return f"{self.prefix}.{self._step}.{tag}.{sender}>{receiver}"

    def _peer(self, tag: str, sending: bool) -> Tuple[int, Any]:
        forward = tag[0] == "F"
        peer = self.next if forward == sending else self.prev
        assert peer is not None, f"stage {self.stage} has no neighbour for {tag}"
        return peer

    def _post(self, tag: str, shape: Tuple[int, ...], dtype: torch.dtype) -> None:
        root, ps = self._peer(tag, sending=False)
        buffer = torch.empty(shape, dtype=dtype, device=self.device)
        name = self._name(tag, root, hvd.rank())
        self._posted[tag] = (hvd.broadcast_async_(buffer, root, name=name, process_set=ps), name)

    def receive(self, tag: str) -> torch.Tensor:
        """Wait for ``tag`` from the neighbour (posting the receive now if it was not posted ahead)."""
        if tag not in self._posted:
            if (self._key, tag) not in self._shapes:
                self._shapes[(self._key, tag)] = self._receive_header(tag)
            self._post(tag, *self._shapes[(self._key, tag)])
        handle, name = self._posted.pop(tag)
        root, _ = self._peer(tag, sending=False)
        return wait(handle, f"stage {self.stage} (rank {hvd.rank()}) waiting for {tag} from rank {root} ({name})",
                    self.timeout)

    def _receive_header(self, tag: str) -> Tuple[Tuple[int, ...], torch.dtype]:
        root, ps = self._peer(tag, sending=False)
        header = torch.zeros(_HEADER, dtype=torch.int64)
        name = self._name(tag, root, hvd.rank()) + ".shape"
        handle = hvd.broadcast_async_(header, root, name=name, process_set=ps)
        header = wait(handle, f"stage {self.stage} (rank {hvd.rank()}) waiting for the shape of {tag} from rank {root}",
                      self.timeout)
        ndim = int(header[0])
        return tuple(int(d) for d in header[1:1 + ndim]), DTYPES[int(header[-1])]

    def send(self, tag: str, tensor: torch.Tensor) -> None:
        """Start sending ``tensor`` as ``tag``; a forward send also posts the matching gradient's receive."""
        receiver, ps = self._peer(tag, sending=True)
        tensor = tensor.detach().contiguous()
        shape = (tuple(tensor.shape), tensor.dtype)
        if tag[0] == "F" and (self._key, tag) not in self._shapes:
            header = torch.zeros(_HEADER, dtype=torch.int64)
            header[0] = tensor.dim()
            header[1:1 + tensor.dim()] = torch.tensor(tensor.shape, dtype=torch.int64)
            header[-1] = dtype_code(tensor.dtype)
            name = self._name(tag, hvd.rank(), receiver) + ".shape"
            self._sends.append((hvd.broadcast_async_(header, hvd.rank(), name=name, process_set=ps), name))
            self._shapes[(self._key, tag)] = shape
        name = self._name(tag, hvd.rank(), receiver)
        self._sends.append((hvd.broadcast_async_(tensor, hvd.rank(), name=name, process_set=ps), name))
        if tag[0] == "F" and self._backward:
            self._post("B" + tag[1:], *shape)  # the gradient has the activation's shape

    def finish(self) -> None:
        """Wait until every message this step sent has been delivered."""
        sends, self._sends = self._sends, []
        for handle, name in sends:
            wait(handle, f"stage {self.stage} (rank {hvd.rank()}) delivering {name}", self.timeout)
