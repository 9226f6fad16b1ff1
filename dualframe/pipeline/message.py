"""The byte layout of a graph pipeline's edge message, framework-neutral: header, tensor bytes, structure tail.

A forward message from stage p to stage c holds every value c reads from p (``graph_walk.edge_values``);
the backward message holds their gradients in the same layout (zeros where a value has none), so the
receiver of a forward message knows the size of the gradient to expect. A message is a flat run of
bytes (a ``uint8`` tensor in the adapters):

- an int64 header: the tensor count, the tail's length, then per tensor its dtype code
  (``layout.DTYPE_NAMES``), ndim and dims (``MAX_DIMS`` of them, zero-filled);
- each tensor's bytes, padded to a multiple of 8, so every dtype travels exactly (int64 ids, bool
  masks) and a value's shape may change between steps;
- where a value is not one tensor, a JSON tail giving the values' structure (a traced size, a shape, a
  flag or None crosses as data; tensors by index into the message's tensors).

This module owns that layout: it writes the header (``header``), reads it back (``read_layout``) and
turns the values' structure into the tail and back (``structure``, ``rebuild``). An adapter keeps only
its tensor <-> bytes conversion and names its framework's non-tensor leaves (``Leaves``).
"""
from __future__ import annotations

import json
from array import array
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Protocol, Sequence, Tuple

from dualframe.errors import StrategyError
from dualframe.pipeline.layout import DTYPE_NAMES, MAX_DIMS

#: int64 fields before the tensors' entries: tensor count, tail length.
HEAD = 2
#: int64 fields per tensor: dtype code, ndim, dims.
FIELDS = 2 + MAX_DIMS
#: Bytes per element of each dtype, by code (``DTYPE_NAMES``).
ITEM_BYTES = (4, 8, 2, 2, 8, 4, 1, 1)
#: Python values a message carries as themselves.
PLAIN = (bool, int, float, str, type(None))
#: What a message may carry, for refusals.
CARRIES = "tensors, numbers, bools, None, strings and tuples, lists and dicts of them"


def padding(size: int) -> int:
    """Zero bytes after a tensor of ``size`` bytes, so the next starts at a multiple of 8.

    Example:
        >>> padding(3), padding(8), padding(0)
        (5, 0, 0)
    """
    return (-size) % 8


def header_bytes(count: int) -> int:
    """Length in bytes of the header of a message of ``count`` tensors."""
    return 8 * (HEAD + FIELDS * count)


def header(tensors: Sequence[Tuple[str, int, Sequence[int]]], tail: int = 0) -> bytes:
    """The header of a message holding ``tensors`` (name, dtype code, shape each) and a ``tail``-byte tail.

    Example:
        >>> len(header([("h", 0, (2, 3))])) == header_bytes(1)
        True

    Raises:
        StrategyError: a tensor of more than ``MAX_DIMS`` dimensions (naming it): cut elsewhere.
    """
    fields = [len(tensors), tail]
    for name, code, shape in tensors:
        if len(shape) > MAX_DIMS:
            raise StrategyError(f"value {name!r} has {len(shape)} dimensions; a message carries at most {MAX_DIMS}")
        fields += [code, len(shape), *shape, *([0] * (MAX_DIMS - len(shape)))]
    return array("q", [int(f) for f in fields]).tobytes()


@dataclass(frozen=True)
class Part:
    """One tensor of a message: its dtype code, shape and place (``offset``, ``size`` bytes without padding)."""

    code: int
    shape: Tuple[int, ...]
    offset: int
    size: int

    @property
    def dtype(self) -> str:
        """The tensor's dtype name (``"float32"``)."""
        return DTYPE_NAMES[self.code]


@dataclass(frozen=True)
class MessageLayout:
    """Where a message's tensors and tail lie (``read_layout``)."""

    parts: Tuple[Part, ...]
    tail_offset: int
    tail_size: int


def read_layout(ints: Callable[[int], List[int]]) -> MessageLayout:
    """The layout of a message, given ``ints(n)``: its first n int64 fields.

    Example:
        >>> raw = header([("ids", 4, (3,)), ("mask", 7, (2, 2))], tail=5)
        >>> layout = read_layout(lambda n: array("q", raw[:8 * n]).tolist())
        >>> [(p.dtype, p.shape, p.offset, p.size) for p in layout.parts], layout.tail_offset
        ([('int64', (3,), 176, 24), ('bool', (2, 2), 200, 4)], 208)
    """
    count, tail = ints(HEAD)
    fields = ints(HEAD + FIELDS * count)
    offset, parts = header_bytes(count), []
    for k in range(count):
        code, ndim, *dims = fields[HEAD + FIELDS * k:HEAD + FIELDS * (k + 1)]
        shape = tuple(int(d) for d in dims[:ndim])
        size = ITEM_BYTES[code]
        for d in shape:
            size *= d
        parts.append(Part(int(code), shape, offset, size))
        offset += size + padding(size)
    return MessageLayout(tuple(parts), offset, int(tail))


class Leaves(Protocol):
    """An adapter's non-tensor leaves of a message's structure (a dtype, a device, a shape type)."""

    def is_tensor(self, value: Any) -> bool:
        """Whether ``value`` is one of the framework's tensors."""

    def encode(self, value: Any) -> Optional[Dict[str, Any]]:
        """``value`` as ``{kind: JSON body}`` when it is a framework leaf, else None (items: plain values)."""

    def decode(self, kind: str, body: Any) -> Any:
        """The leaf an ``encode`` of ``kind`` made."""


def _encode(value: Any, tensors: List[Any], leaves: Leaves) -> Any:
    """``value`` as JSON data, its tensors appended to ``tensors`` and referred to by index."""
    if leaves.is_tensor(value):
        tensors.append(value)
        return {"t": len(tensors) - 1}
    if isinstance(value, PLAIN):
        return value
    leaf = leaves.encode(value)
    if leaf is not None:
        return leaf
    if isinstance(value, dict):
        return {"dict": [[k, _encode(v, tensors, leaves)] for k, v in value.items()]}
    return {"tuple" if isinstance(value, tuple) else "list": [_encode(v, tensors, leaves) for v in value]}


def structure(values: Sequence[Any], leaves: Leaves) -> Tuple[List[Any], bytes]:
    """(the tensors of ``values`` in order, the JSON tail; empty where every value is one tensor).

    Example:
        >>> class Ints:   # a toy framework whose tensors are ints
        ...     def is_tensor(self, v): return type(v) is int
        ...     def encode(self, v): return None
        ...     def decode(self, kind, body): raise KeyError(kind)
        >>> tensors, tail = structure([1, (None, 2.5, [3])], Ints())
        >>> tensors, rebuild(tail, tensors, Ints())
        ([1, 3], [1, (None, 2.5, [3])])
    """
    if all(leaves.is_tensor(v) for v in values):
        return list(values), b""
    tensors: List[Any] = []
    return tensors, json.dumps([_encode(v, tensors, leaves) for v in values]).encode()


def _decode(data: Any, tensors: Sequence[Any], leaves: Leaves) -> Any:
    if not isinstance(data, dict):
        return data
    (kind, body), = data.items()
    if kind == "t":
        return tensors[body]
    if kind == "dict":
        return {k: _decode(v, tensors, leaves) for k, v in body}
    if kind in ("tuple", "list"):
        items = [_decode(v, tensors, leaves) for v in body]
        return tuple(items) if kind == "tuple" else items
    return leaves.decode(kind, body)


def rebuild(tail: bytes, tensors: Sequence[Any], leaves: Leaves) -> List[Any]:
    """The values a ``structure`` tail describes, its tensors taken from ``tensors``; ``tensors`` without a tail."""
    if not tail:
        return list(tensors)
    return [_decode(v, tensors, leaves) for v in json.loads(tail)]


def unsendable(value: Any, leaf: Callable[[Any], bool]) -> Optional[str]:
    """The type name of the first part of ``value`` that a message cannot carry; None where all of it can.

    ``leaf(x)``: whether x is one of the framework's leaves (a tensor, a dtype, a traced size). A
    message carries those, ``PLAIN`` values, and tuples, lists and dicts (string keys) of them.

    Example:
        >>> unsendable((1, [None, "a"], {"k": 2.5}), lambda x: False), unsendable([1, object()], lambda x: False)
        (None, 'object')
    """
    if isinstance(value, PLAIN) or leaf(value):
        return None
    if isinstance(value, (list, tuple)):
        return next((bad for bad in (unsendable(v, leaf) for v in value) if bad is not None), None)
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return next((bad for bad in (unsendable(v, leaf) for v in value.values()) if bad is not None), None)
    return type(value).__name__


def check_sendable(values: Sequence[Any], names: Sequence[str], leaf: Callable[[Any], bool]) -> None:
    """Refuse a value a message cannot carry, naming it (``unsendable``).

    Raises:
        StrategyError: naming the value and what it holds.
    """
    for name, value in zip(names, values):
        bad = unsendable(value, leaf)
        if bad is not None:
            raise StrategyError(f"value {name!r} crosses between process stages and holds a {bad}, which a "
                                f"message cannot carry ({CARRIES} can); choose a cut where it does not cross")
