"""Argument checks shared by both data-parallel adapters, run before any computation or communication."""
from __future__ import annotations

from typing import Any, Callable, List, Mapping, Optional, Union

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


def check_groups(
    groups: object, word: str, is_member: Optional[Callable[[object], bool]] = None,
    describe: Callable[[object], str] = lambda member: "",
) -> Union[None, int, List[List[Any]]]:
    """Horovod's ``groups``: None, an int >= 1, or lists of the optimizer's ``word``s, each at most once.

    The adapter hands in what is its own: ``word`` names a member in the messages ("parameter",
    "variable"), ``is_member`` says whether an object may be listed (None: anything), ``describe``
    adds to the message about a member listed twice (e.g. ``", shape (2, 3)"``).

    Example:
        >>> check_groups(2, "variable")
        2
        >>> check_groups([["a"], ["b", "c"]], "variable")
        [['a'], ['b', 'c']]
        >>> check_groups([["a"], ["a"]], "variable")
        Traceback (most recent call last):
        ...
        dualframe.errors.StrategyError: a variable can appear only once in groups (again in groups[1])

    Returns:
        None, the int, or the groups as lists of their members.

    Raises:
        StrategyError: anything else, a member ``is_member`` refuses, or a member listed twice.
    """
    if groups is None:
        return None
    rule = f"groups must be an int >= 1 or a list of lists of {word}s"
    if isinstance(groups, int) and not isinstance(groups, bool):
        if groups < 1:
            raise StrategyError(f"{rule} (groups: {groups})")
        return groups
    if not isinstance(groups, (list, tuple)) or not all(isinstance(g, (list, tuple)) for g in groups):
        raise StrategyError(f"{rule} (groups: {groups!r:.80})")
    seen: set = set()
    for g, group in enumerate(groups):
        for member in group:
            if is_member is not None and not is_member(member):
                raise StrategyError(
                    f"groups[{g}] holds something that is not a {word} of the optimizer ({type(member).__name__})")
            if id(member) in seen:
                raise StrategyError(f"a {word} can appear only once in groups (again in groups[{g}]{describe(member)})")
            seen.add(id(member))
    return [list(group) for group in groups]


def check_bool(name: str, value: object) -> bool:
    """``value`` must be a bool (not a truthy string or number)."""
    if not isinstance(value, bool):
        raise StrategyError(f"{name} must be True or False ({name}: {value!r})")
    return value
