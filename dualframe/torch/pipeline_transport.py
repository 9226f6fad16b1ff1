"""The torch calls a pipeline link needs: tensors, Horovod's asynchronous broadcast and allreduce (the core's
``Wire``), and MPI point-to-point through mpi4py when the job runs on MPI (the core's ``PointToPoint``).

What moves, when, under which name, and how long a wait may last is the core's
(``dualframe.stage_link``); this module only makes torch tensors and starts, polls and finishes
``horovod.torch`` operations and mpi4py requests.
"""
from __future__ import annotations

import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from dualframe.errors import StrategyError
from dualframe.stage_link import Shape, agree_transport, largest_tag, transport_choice, transport_votes
from dualframe.stage_setup import DTYPE_NAMES, PeerLostError, resolve_process_sets
from dualframe.torch.collectives import hvd

__all__ = ["DTYPES", "PeerLostError", "TorchMPI", "TorchWire", "dtype_code", "point_to_point", "process_sets"]

#: dtypes a message may carry, by code (``dualframe.stage_setup.DTYPE_NAMES``).
DTYPES = tuple(getattr(torch, name) for name in DTYPE_NAMES)


def dtype_code(dtype: torch.dtype) -> int:
    """Index of ``dtype`` in DTYPES; StrategyError for others."""
    if dtype not in DTYPES:
        raise StrategyError(f"pipeline messages must have one of the dtypes {[str(d) for d in DTYPES]} (dtype: {dtype})")
    return DTYPES.index(dtype)


def process_sets(needed: Sequence[Sequence[int]]) -> Dict[Tuple[int, ...], Any]:
    """Horovod ProcessSets for the rank groups ``needed`` (see ``dualframe.stage_setup.resolve_process_sets``)."""
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
        return _poll(lambda: hvd.poll(handle), timeout)

    def result(self, handle: Any) -> torch.Tensor:
        return hvd.synchronize(handle)

    def stopped(self, error: BaseException) -> Optional[str]:
        return str(error) if isinstance(error, hvd.HorovodInternalError) else None


def _poll(finished: Any, timeout: float) -> bool:
    """Call ``finished()`` until it is true, sleeping at most 0.2 ms between calls; False after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    pause = 0.0
    while not finished():
        if time.monotonic() > deadline:
            return False
        time.sleep(pause)
        pause = min(0.0002, pause + 0.00005)
    return True


def _bytes(tensor: torch.Tensor) -> Any:
    # A flat byte view: MPI moves any dtype (bfloat16 included, which numpy lacks) without a copy.
    return tensor.reshape(-1).view(torch.uint8).numpy()


class TorchMPI:
    """MPI's nonblocking send and receive of CPU tensors on a communicator of their own (the core's ``PointToPoint``).

    Example:
        >>> direct = point_to_point(torch.device("cpu"), chunks=8, name="dpipe0")   # doctest: +SKIP
        >>> handle = direct.send(x, dest=1, tag=0); direct.done(handle, timeout=5.0)  # doctest: +SKIP
    """

    def __init__(self, comm: Any) -> None:
        self.comm = comm

    def send(self, tensor: torch.Tensor, dest: int, tag: int) -> Any:
        data = tensor.detach().contiguous()
        return self.comm.Isend(_bytes(data), dest=dest, tag=tag), data  # the tensor lives as long as the request

    def receive(self, buffer: torch.Tensor, source: int, tag: int) -> Any:
        return self.comm.Irecv(_bytes(buffer), source=source, tag=tag), buffer

    def done(self, handle: Any, timeout: float) -> bool:
        return _poll(handle[0].Test, timeout)

    def result(self, handle: Any) -> torch.Tensor:
        return handle[1]

    def stopped(self, error: BaseException) -> Optional[str]:
        return None  # MPI's errors abort the job (MPI_ERRORS_ARE_FATAL): nothing here to explain


def _mpi_missing(device: torch.device, chunks: int) -> Optional[str]:
    """Why this rank cannot send pipeline messages over MPI point-to-point; None when it can."""
    if device.type != "cpu":
        return f"the stage is on {device} (MPI moves CPU tensors here; GPU tensors go through Horovod)"
    if not hvd.mpi_enabled():
        return "Horovod runs on Gloo, not MPI (horovodrun --gloo)"
    try:
        from mpi4py import MPI
    except ImportError:
        return "mpi4py is not installed"
    if MPI.Query_thread() != MPI.THREAD_MULTIPLE:
        return "MPI was started without MPI_THREAD_MULTIPLE (Horovod's thread uses MPI too)"
    world = MPI.COMM_WORLD
    if (world.Get_rank(), world.Get_size()) != (int(hvd.rank()), int(hvd.size())):
        return "Horovod's ranks are not MPI_COMM_WORLD's (hvd.init(comm=...))"
    if int(world.Get_attr(MPI.TAG_UB) or 0) < largest_tag(chunks):
        return f"MPI's largest tag is below {largest_tag(chunks)} (chunks: {chunks})"
    return None


def point_to_point(device: torch.device, chunks: int, name: str) -> Optional[TorchMPI]:
    """MPI point-to-point for a pipeline when every rank has it (``DUALFRAME_PIPELINE_TRANSPORT``); else None.

    A collective over every rank (one small allreduce, then MPI_Comm_dup): call it on all of them.

    Raises:
        StrategyError: a bad or uneven ``DUALFRAME_PIPELINE_TRANSPORT``, or "mpi" where MPI cannot carry it.
    """
    choice = transport_choice()
    missing = None if choice == "horovod" else _mpi_missing(device, chunks)
    votes = torch.tensor(transport_votes(choice, missing), dtype=torch.int64)
    sums = hvd.allreduce(votes, op=hvd.Sum, name=f"{name}.transport").tolist()
    if not agree_transport(sums, int(hvd.size()), choice, missing):
        return None
    from mpi4py import MPI

    return TorchMPI(MPI.COMM_WORLD.Dup())
