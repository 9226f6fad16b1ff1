"""Argument checks shared by both data-parallel adapters, run before any computation or communication."""
from __future__ import annotations

from typing import Any, Mapping

from dualframe.dp.compression import CompressionSet, FP16Compressor, NoneCompressor
from dualframe.errors import StrategyError
from dualframe.strategy import DataParallel


def check_compression(compression: object, compressions: CompressionSet[Any]) -> Any:
    """The compressor meant by ``compression``: ``Compression.none``/``.fp16``, their names, or a custom one.

    A custom compressor is any object with ``compress(tensor) -> (tensor, ctx)`` and
    ``decompress(tensor, ctx)``, as in Horovod.

    Raises:
        StrategyError: an unknown name, or an object without those two methods.
    """
    if isinstance(compression, str):
        return compressions.by_name(compression.lower())
    if callable(getattr(compression, "compress", None)) and callable(getattr(compression, "decompress", None)):
        return compression
    raise StrategyError(
        f"unknown compression {compression!r}; use hvd.Compression.none, hvd.Compression.fp16 (or 'none', "
        f"'fp16'), or an object with compress(tensor) -> (tensor, ctx) and decompress(tensor, ctx)"
    )


def compression_name(compressor: object) -> str:
    """``"none"`` or ``"fp16"`` for the shared compressors (a strategy's ``compression``).

    Raises:
        StrategyError: a custom compressor, which has no name to save in a config.
    """
    if isinstance(compressor, NoneCompressor):
        return "none"
    if isinstance(compressor, FP16Compressor):
        return "fp16"
    raise StrategyError(
        f"only hvd.Compression.none and hvd.Compression.fp16 can be saved in a config (compression: {compressor!r})"
    )


def op_name(op: object, ops: Mapping[str, object]) -> str:
    """The core's name (``"average"`` ...) of an op name or of one of the adapter's Horovod op constants."""
    if isinstance(op, str) and op.lower() in ops:
        return op.lower()
    if not isinstance(op, (str, bool)):
        for name, constant in ops.items():
            if op is constant or (type(op) is type(constant) and op == constant):
                return name
    raise StrategyError(f"unknown op {op!r}; use one of hvd.Average, hvd.Sum, hvd.Adasum, hvd.Min, hvd.Max, "
                        f"hvd.Product (or their names: {', '.join(ops)})")


def check_data_parallel(
    op: str, compression: str = "none", backward_passes_per_step: object = 1, gradient_predivide_factor: object = 1.0
) -> DataParallel:
    """Validate the numeric data-parallel arguments through the core's DataParallel and return it."""
    return DataParallel(
        backward_passes_per_step=backward_passes_per_step,  # type: ignore[arg-type]
        op=op, compression=compression,
        gradient_predivide_factor=gradient_predivide_factor,  # type: ignore[arg-type]
    )


def check_root_rank(root_rank: object, size: int) -> int:
    """``root_rank`` must be an int in ``[0, size)``."""
    if isinstance(root_rank, bool) or not isinstance(root_rank, int) or not 0 <= root_rank < size:
        raise StrategyError(f"root_rank must be an int in [0, {size}) (root_rank: {root_rank!r}, size: {size})")
    return root_rank


def check_bool(name: str, value: object) -> bool:
    """``value`` must be a bool (not a truthy string or number)."""
    if not isinstance(value, bool):
        raise StrategyError(f"{name} must be True or False ({name}: {value!r})")
    return value
