"""The torch backend: the one object implementing the core's ``Backend`` protocol (``dualframe.backend``)."""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from dualframe.pipeline.mpi_direct import MPIDirect
from dualframe.reliability.checkpoint import split_gathered
from dualframe.torch.collectives import TorchBatchOps, TorchCaster, TorchCollectives, collectives, hvd
from dualframe.torch.pipeline_transport import TorchWire, point_to_point, process_sets


class TorchPlacement:
    """torch's devices for a stage (the core's ``Placement``): ``"cpu"`` then each CUDA device.

    Example:
        >>> TorchPlacement().device(None)          # doctest: +SKIP
        device(type='cpu')
    """

    def available_devices(self) -> List[str]:
        """``"cpu"`` then every visible CUDA device (``"cuda:0"`` ...)."""
        from dualframe.torch.model_parallel import available_devices

        return available_devices()

    def device(self, name: Optional[str]) -> torch.device:
        """``torch.device(name)``; the CPU when ``name`` is None."""
        return torch.device(name if name else "cpu")


def _distributed() -> bool:
    return bool(hvd.is_initialized()) and int(hvd.size()) > 1


def gather_bytes(data: bytes, name: str, process_set: Any = None) -> List[bytes]:
    """Every rank's ``data`` (of ``process_set``, default all), in rank order (only this rank's outside a distributed job)."""
    if not _distributed():
        return [data]
    group = {} if process_set is None else {"process_set": process_set}
    payload = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    lengths = hvd.allgather(torch.tensor([len(data)], dtype=torch.int64), name=f"{name}.lengths", **group)
    joined = hvd.allgather(payload, name=f"{name}.bytes", **group).numpy().tobytes()
    return split_gathered(joined, lengths.numpy().tolist())


def broadcast_bytes(data: Optional[bytes], root_rank: int, name: str, process_set: Any = None) -> bytes:
    """Root's ``data`` on every rank (of ``process_set``, default all; ``b""`` when root has none)."""
    if not _distributed():
        return data or b""
    group = {} if process_set is None else {"process_set": process_set}
    length = hvd.broadcast(torch.tensor([len(data or b"")], dtype=torch.int64), root_rank, name=f"{name}.length",
                           **group)
    size = int(length.item())
    if size == 0:
        return b""
    buffer = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.zeros(size, dtype=torch.uint8)
    return hvd.broadcast(buffer, root_rank, name=f"{name}.bytes", **group).numpy().tobytes()


class TorchBackend:
    """PyTorch under the core's ``Backend``: collectives, casts, batch split, placement, pipeline wire, checkpoint bytes.

    Example:
        >>> from dualframe.torch.backend import BACKEND                   # doctest: +SKIP
        >>> BACKEND.batches.split(torch.arange(6), [4, 2])                 # doctest: +SKIP
        [tensor([0, 1, 2, 3]), tensor([4, 5])]
    """

    name = "torch"

    def __init__(self) -> None:
        self.collectives: TorchCollectives = collectives
        self.caster = TorchCaster()
        self.batches = TorchBatchOps()
        self.placement = TorchPlacement()

    def wire(self, device: torch.device) -> TorchWire:
        """``TorchWire`` receiving into ``device``."""
        return TorchWire(device)

    def point_to_point(self, device: torch.device, chunks: int, name: str) -> Optional[MPIDirect[torch.Tensor]]:
        """MPI point-to-point when every rank has it, else None (a collective)."""
        return point_to_point(device, chunks, name)

    def process_sets(self, needed: Sequence[Sequence[int]]) -> Dict[Tuple[int, ...], Any]:
        """Horovod process sets for ``needed`` (``dualframe.pipeline.layout.resolve_process_sets``)."""
        return process_sets(needed)

    def gather_bytes(self, data: bytes, name: str, process_set: Any = None) -> List[bytes]:
        """See ``gather_bytes``."""
        return gather_bytes(data, name, process_set)

    def broadcast_bytes(self, data: Optional[bytes], root_rank: int, name: str, process_set: Any = None) -> bytes:
        """See ``broadcast_bytes``."""
        return broadcast_bytes(data, root_rank, name, process_set)


#: The torch adapter's one Backend.
BACKEND = TorchBackend()
