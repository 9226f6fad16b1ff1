"""The Protocols each framework adapter implements; the core plans against these, never a framework."""
from __future__ import annotations

from typing import Any, List, Optional, Protocol, Sequence, TypeVar, runtime_checkable

T = TypeVar("T")


@runtime_checkable
class Collectives(Protocol[T]):
    """Horovod-backed collectives on one framework's tensors.

    Example:
        >>> from dualframe.torch import collectives       # doctest: +SKIP
        >>> collectives.init()                            # doctest: +SKIP
        >>> collectives.allreduce(torch.ones(3), op="sum")  # doctest: +SKIP
    """

    def init(self, process_sets: Optional[Sequence[Sequence[int]]] = None) -> None:
        """Start Horovod (idempotent)."""

    def is_initialized(self) -> bool:
        """True once ``init`` has run."""

    def rank(self) -> int:
        """This process's rank in the job."""

    def size(self) -> int:
        """Number of processes in the job."""

    def allreduce(self, tensor: T, op: str = "average", name: Optional[str] = None) -> T:
        """Reduce ``tensor`` over all ranks with the core op name (``"average"``, ``"sum"`` ...)."""

    def broadcast(self, tensor: T, root_rank: int, name: Optional[str] = None) -> T:
        """Return root_rank's ``tensor`` on every rank."""

    def allgather(self, tensor: T, name: Optional[str] = None) -> T:
        """Concatenate every rank's ``tensor`` along the first axis."""

    def barrier(self) -> None:
        """Wait until every rank gets here."""


@runtime_checkable
class TensorCaster(Protocol[T]):
    """The two primitives shared behaviours (fp16 compression) need from a framework."""

    def dtype_name(self, tensor: T) -> str:
        """The dtype's short name: ``"float32"``, ``"float16"``, ``"int64"`` ..."""

    def cast(self, tensor: T, dtype_name: str) -> T:
        """``tensor`` converted to the dtype with that short name."""


@runtime_checkable
class BatchOps(Protocol[T]):
    """Cutting a batch into micro-batches and joining them back, along the first axis."""

    def split(self, batch: T, sizes: Sequence[int]) -> List[T]:
        """Split ``batch`` into consecutive pieces of the given row counts."""

    def concat(self, parts: Sequence[T]) -> T:
        """Join pieces back along the first axis."""


@runtime_checkable
class Placement(Protocol):
    """Naming and checking the devices a framework can place layers on."""

    def available_devices(self) -> List[str]:
        """Device names usable here, in the framework's spelling (``"cuda:0"``, ``"/GPU:0"``)."""

    def validate_device(self, device: str) -> Any:
        """Return the framework's device object for ``device``; raise DeviceError if unusable."""
