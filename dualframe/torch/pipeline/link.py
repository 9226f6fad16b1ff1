"""The torch calls a pipeline link needs: tensors, Horovod's asynchronous broadcast and allreduce (the core's
``Wire``), and byte views for point-to-point (the core's ``PointToPoint``: MPI through mpi4py when the
job runs on MPI, else ZeroMQ; ``dualframe.pipeline.direct`` chooses).

What moves, when, under which name, and how long a wait may last is the core's
(``dualframe.pipeline.link``); this module only makes torch tensors and starts, polls and finishes
``horovod.torch`` operations, and hands the point-to-point transport torch tensors' bytes.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from dualframe.errors import StrategyError
from dualframe.pipeline.direct import Direct, open_direct
from dualframe.pipeline.mpi_direct import poll
from dualframe.pipeline.link import Shape
from dualframe.pipeline.layout import DTYPE_NAMES, PeerLostError, resolve_process_sets
from dualframe.torch.collectives import hvd

__all__ = ["DTYPES", "PeerLostError", "TorchWire", "dtype_code", "point_to_point", "process_sets"]

#: dtypes a message may carry, by code (``dualframe.pipeline.layout.DTYPE_NAMES``).
DTYPES = tuple(getattr(torch, name) for name in DTYPE_NAMES)


def dtype_code(dtype: torch.dtype) -> int:
    """Index of ``dtype`` in DTYPES; StrategyError for others."""
    if dtype not in DTYPES:
        raise StrategyError(f"pipeline messages must have one of the dtypes {[str(d) for d in DTYPES]} (dtype: {dtype})")
    return DTYPES.index(dtype)


def process_sets(needed: Sequence[Sequence[int]]) -> Dict[Tuple[int, ...], Any]:
    """Horovod ProcessSets for the rank groups ``needed`` (see ``dualframe.pipeline.layout.resolve_process_sets``)."""
    from horovod.common import process_sets as registry

    return resolve_process_sets(hvd, registry, needed)


class TorchWire:
    """``horovod.torch`` under the core's ``Wire``: receive buffers on ``device``, small tensors on the host.

    Example:
        >>> wire = TorchWire(torch.device("cpu"))                                  # doctest: +SKIP
        >>> handle = wire.broadcast(x, 0, "x", hvd.global_process_set)             # doctest: +SKIP
        >>> wire.done(handle, timeout=5.0) and wire.result(handle)                  # doctest: +SKIP
    """

    def __init__(self, device: torch.device = torch.device("cpu")) -> None:
        self.device = device

    def tensor(self, values: Sequence[float], code: int) -> torch.Tensor:
        return torch.tensor(list(values), dtype=DTYPES[code])

    def empty(self, shape: Tuple[int, ...], code: int) -> torch.Tensor:
        return torch.empty(shape, dtype=DTYPES[code], device=self.device)

    def describe(self, tensor: torch.Tensor) -> Shape:
        return tuple(tensor.shape), dtype_code(tensor.dtype)

    def values(self, tensor: torch.Tensor) -> List[Any]:
        return list(tensor.flatten().tolist())

    def broadcast(self, tensor: torch.Tensor, root_rank: int, name: str, process_set: Any) -> Any:
        # In place: the root's tensor goes out, the others' buffer is filled (detached: no autograd).
        return hvd.broadcast_async_(tensor.detach().contiguous(), root_rank, name=name, process_set=process_set)

    def allreduce(self, tensor: torch.Tensor, op: str, name: str, process_set: Any) -> Any:
        return hvd.allreduce_async(tensor, op=hvd.Sum if op == "sum" else hvd.Average, name=name,
                                   process_set=process_set)

    def done(self, handle: Any, timeout: float) -> bool:
        return poll(lambda: hvd.poll(handle), timeout)

    def result(self, handle: Any) -> torch.Tensor:
        return hvd.synchronize(handle)

    def stopped(self, error: BaseException) -> Optional[str]:
        return str(error) if isinstance(error, hvd.HorovodInternalError) else None



def _byte_view(tensor: torch.Tensor) -> Any:
    # A flat byte view: MPI moves any dtype (bfloat16 included, which numpy lacks) without a copy.
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy()


def point_to_point(device: torch.device, chunks: int, name: str, transport: Optional[str] = None) -> Optional[Direct]:
    """MPI or ZeroMQ point-to-point for a pipeline when every rank has it (``dualframe.pipeline.direct.open_direct``); else None.

    A collective over every rank: call it on all of them.

    Raises:
        StrategyError: a bad or uneven ``transport`` / ``DUALFRAME_PIPELINE_TRANSPORT``, or "mpi" / "zmq" where a rank lacks it.
    """
    def vote(votes: List[int]) -> List[int]:
        return hvd.allreduce(torch.tensor(votes, dtype=torch.int64), op=hvd.Sum, name=f"{name}.transport").tolist()

    def gather(entry: Any) -> List[Any]:
        return list(hvd.allgather_object(entry, name=f"{name}.addresses"))

    return open_direct("" if device.type == "cpu" else str(device), bool(hvd.mpi_enabled()), int(hvd.rank()),
                       int(hvd.size()), chunks, vote, gather, _byte_view,
                       lambda buffer: (_byte_view(buffer), lambda: buffer), transport)
