"""PyTorch collectives over horovod.torch, implementing the core's Collectives protocol."""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence

import torch

from dualframe._deps import require
from dualframe.errors import NotInitializedError, StrategyError
from dualframe.strategy import REDUCE_OPS

hvd = require("horovod.torch", "Horovod for PyTorch (horovod.torch)")

#: Core op names -> Horovod's op constants.
OPS: Dict[str, object] = {
    "average": hvd.Average, "sum": hvd.Sum, "adasum": hvd.Adasum,
    "min": hvd.Min, "max": hvd.Max, "product": hvd.Product,
}
assert set(OPS) == set(REDUCE_OPS)


def op_of(op: object) -> object:
    """Horovod's op for a core op name or a Horovod op constant."""
    if isinstance(op, str):
        if op.lower() not in OPS:
            raise StrategyError(f"unknown op {op!r}; choose one of {', '.join(REDUCE_OPS)}")
        return OPS[op.lower()]
    if op in OPS.values():
        return op
    raise StrategyError(f"unknown op {op!r}; use one of hvd.Average, hvd.Sum, hvd.Adasum, hvd.Min, hvd.Max")


def check_initialized(what: str) -> None:
    """Raise NotInitializedError naming ``what`` unless Horovod is running."""
    if not hvd.is_initialized():
        raise NotInitializedError(f"{what} needs dualframe.torch.init() first (call hvd.init() at the top of the script)")


class TorchCollectives:
    """Horovod collectives on torch tensors (the core's Collectives protocol).

    Example:
        >>> from dualframe.torch.collectives import TorchCollectives  # doctest: +SKIP
        >>> c = TorchCollectives(); c.init()                           # doctest: +SKIP
        >>> c.allreduce(torch.ones(2), op="sum")                       # doctest: +SKIP
    """

    def init(self, process_sets: Optional[Sequence[Sequence[int]]] = None) -> None:
        """Start Horovod once; later calls do nothing."""
        if not hvd.is_initialized():
            if process_sets:
                hvd.init(process_sets=[hvd.ProcessSet(list(ranks)) for ranks in process_sets])
            else:
                hvd.init()

    def is_initialized(self) -> bool:
        return bool(hvd.is_initialized())

    def rank(self) -> int:
        check_initialized("rank()")
        return int(hvd.rank())

    def size(self) -> int:
        check_initialized("size()")
        return int(hvd.size())

    def allreduce(self, tensor: torch.Tensor, op: str = "average", name: Optional[str] = None) -> torch.Tensor:
        check_initialized("allreduce")
        return hvd.allreduce(tensor, name=name, op=op_of(op))

    def broadcast(self, tensor: torch.Tensor, root_rank: int, name: Optional[str] = None) -> torch.Tensor:
        check_initialized("broadcast")
        return hvd.broadcast(tensor, root_rank, name=name)

    def allgather(self, tensor: torch.Tensor, name: Optional[str] = None) -> torch.Tensor:
        check_initialized("allgather")
        return hvd.allgather(tensor, name=name)

    def barrier(self) -> None:
        check_initialized("barrier")
        hvd.barrier()


class TorchBatchOps:
    """Split and concatenate torch batches along the first axis (the core's BatchOps protocol)."""

    def split(self, batch: torch.Tensor, sizes: Sequence[int]) -> List[torch.Tensor]:
        return list(torch.split(batch, list(sizes), dim=0))

    def concat(self, parts: Sequence[torch.Tensor]) -> torch.Tensor:
        return torch.cat(list(parts), dim=0)


class TorchCaster:
    """dtype names and casts for torch tensors (the core's TensorCaster protocol)."""

    def dtype_name(self, tensor: torch.Tensor) -> str:
        return str(tensor.dtype).replace("torch.", "")

    def cast(self, tensor: torch.Tensor, dtype_name: str) -> torch.Tensor:
        return tensor.to(getattr(torch, dtype_name))


collectives = TorchCollectives()

# Under a launcher, a rank that fails or stalls ends the whole job, naming itself and the cause.
from dualframe.torch.failure import install as _install_failure_hooks  # noqa: E402
from dualframe.launch import mpi_defaults as _mpi_defaults  # noqa: E402

_install_failure_hooks()
# Before hvd.init() starts MPI: waits that give the core away (dualframe.launch.mpi_defaults).
_mpi_defaults.apply()
