"""PyTorch collectives over horovod.torch, implementing the core's Collectives protocol."""
from __future__ import annotations

from typing import List, Sequence

import torch

from dualframe._deps import require
from dualframe.collectives import HorovodCollectives

hvd = require("horovod.torch", "Horovod for PyTorch (horovod.torch)")


class TorchCollectives(HorovodCollectives[torch.Tensor]):
    """Horovod collectives on torch tensors (the core's Collectives protocol, written once in
    ``dualframe.collectives``).

    Example:
        >>> from dualframe.torch.collectives import TorchCollectives  # doctest: +SKIP
        >>> c = TorchCollectives(); c.init()                           # doctest: +SKIP
        >>> c.allreduce(torch.ones(2), op="sum")                       # doctest: +SKIP
    """

    def __init__(self) -> None:
        super().__init__(hvd, "dualframe.torch")

    def byte_tensor(self, data: bytes) -> torch.Tensor:
        return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.zeros(0, dtype=torch.uint8)

    def int64_tensor(self, values: Sequence[int]) -> torch.Tensor:
        return torch.tensor(list(values), dtype=torch.int64)

    def host_bytes(self, tensor: torch.Tensor) -> bytes:
        return bytes(tensor.cpu().numpy().tobytes())


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
#: Core op names -> Horovod's op constants.
OPS = collectives.ops
op_of = collectives.op_of
check_initialized = collectives.check_initialized

# Under a launcher, a rank that fails or stalls ends the whole job, naming itself and the cause.
from dualframe.torch.reliability.failure import install as _install_failure_hooks  # noqa: E402
from dualframe.launch import mpi_defaults as _mpi_defaults  # noqa: E402

_install_failure_hooks()
# Before hvd.init() starts MPI: waits that give the core away (dualframe.launch.mpi_defaults).
_mpi_defaults.apply()
