"""Gradient compression written once for both frameworks: cast down before the reduce, back after."""
from __future__ import annotations

from typing import Any, Generic, Optional, Tuple, TypeVar

from dualframe.backend import TensorCaster

T = TypeVar("T")

_FLOATS = ("float32", "float64", "bfloat16")


class NoneCompressor(Generic[T]):
    """Sends tensors as they are (Horovod's ``Compression.none``).

    Example:
        >>> NoneCompressor().compress(3.0)
        (3.0, None)
    """

    def compress(self, tensor: T) -> Tuple[T, Any]:
        """Return the tensor unchanged and no context."""
        return tensor, None

    def decompress(self, tensor: T, ctx: Any) -> T:
        """Return the tensor unchanged."""
        return tensor


class FP16Compressor(Generic[T]):
    """Casts floating-point tensors to float16 for the reduce and back to their dtype after.

    Example:
        >>> from dualframe.torch import Compression   # doctest: +SKIP
        >>> sent, ctx = Compression.fp16.compress(grad)  # doctest: +SKIP
        >>> grad = Compression.fp16.decompress(reduced, ctx)  # doctest: +SKIP
    """

    def __init__(self, caster: TensorCaster[T]) -> None:
        self._caster = caster

    def compress(self, tensor: T) -> Tuple[T, Optional[str]]:
        """Return the float16 tensor and the dtype to restore (None when nothing was cast)."""
        dtype = self._caster.dtype_name(tensor)
        if dtype in _FLOATS:
            return self._caster.cast(tensor, "float16"), dtype
        return tensor, None

    def decompress(self, tensor: T, ctx: Optional[str]) -> T:
        """Cast back to the dtype recorded by ``compress``."""
        return tensor if ctx is None else self._caster.cast(tensor, ctx)


class CompressionSet(Generic[T]):
    """Horovod's ``Compression`` namespace (``.none``, ``.fp16``) for one framework's caster."""

    def __init__(self, caster: TensorCaster[T]) -> None:
        self.none: NoneCompressor[T] = NoneCompressor()
        self.fp16: FP16Compressor[T] = FP16Compressor(caster)

    def by_name(self, name: str) -> Any:
        """The compressor named ``"none"`` or ``"fp16"`` (a strategy's ``compression``)."""
        from dualframe.strategy import COMPRESSIONS
        from dualframe.errors import StrategyError

        if name not in COMPRESSIONS:
            raise StrategyError(f"unknown compression {name!r}; choose one of {', '.join(COMPRESSIONS)}")
        return getattr(self, name)
