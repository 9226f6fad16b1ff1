"""Sharded data parallelism (ZeRO-1/2) as data: which slice of the flat parameters each rank owns, for both adapters.

A rank in plain data parallelism holds every parameter's gradient and optimizer state. With
``shard="optimizer"`` (ZeRO stage 1) the parameters, flattened and concatenated bucket by bucket,
are cut into one equal slice per rank: gradients are reduce-scattered so a rank receives the reduced
gradient of its slice only, it updates that slice with an optimizer whose state covers the slice,
and the updated slices are allgathered back into every parameter. ``shard="gradients"`` (ZeRO
stage 2) also drops the full gradient as soon as its bucket is reduce-scattered.

The core decides the cut (this module); the adapters move the bytes (Horovod's reducescatter and
allgather) and run the optimizer. Slices are contiguous ranges of a bucket's flat buffer, so an
element-wise optimizer (SGD with momentum, Adam, AdamW, RMSprop ...) updates each element exactly as
it would unsharded.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from dualframe.errors import StrategyError

#: The values of ``DistributedOptimizer(shard=...)`` besides None.
SHARD_MODES = ("optimizer", "gradients", "parameters")
#: The reduction ops a reduce-scatter can carry.
SHARD_OPS = ("average", "sum")
#: The adapters' largest bucket, in elements (16 MiB of float32): small enough that the first
#: reduce-scatters start while backward still runs, large enough that each moves a few MiB.
BUCKET_ELEMENTS = 1 << 22


def check_shard(shard: object, op: str = "average") -> Optional[str]:
    """The shard mode meant by ``shard`` (None, ``"optimizer"`` or ``"gradients"``), checked against ``op``.

    Args:
        shard: None (or ``"none"``), ``"optimizer"``, ``"gradients"`` or ``"parameters"`` (ZeRO-3, ``dualframe.dp.zero3``).
        op: the core's name of the reduction op (``"average"`` ...).

    Raises:
        StrategyError: an unknown mode, or an op a reduce-scatter cannot carry (Adasum, Min, Max, Product).

    Example:
        >>> check_shard("optimizer"), check_shard(None), check_shard("none")
        ('optimizer', None, None)
        >>> check_shard("weights")
        Traceback (most recent call last):
        ...
        dualframe.errors.StrategyError: unknown shard 'weights'; use None, 'optimizer' (ZeRO-1), 'gradients' (ZeRO-2) or 'parameters' (ZeRO-3)
    """
    if shard is None or (isinstance(shard, str) and shard.lower() == "none"):
        return None
    if not isinstance(shard, str) or shard.lower() not in SHARD_MODES:
        raise StrategyError(f"unknown shard {shard!r}; use None, 'optimizer' (ZeRO-1), 'gradients' (ZeRO-2) "
                           f"or 'parameters' (ZeRO-3)")
    if op not in SHARD_OPS:
        why = (" Adasum combines whole gradients pairwise, so it cannot be split by rank."
               if op == "adasum" else "")
        raise StrategyError(
            f"shard={shard.lower()!r} reduce-scatters the gradients, which needs op Average or Sum (op: {op}).{why} "
            f"Use op=hvd.Average, or shard=None"
        )
    return shard.lower()


@dataclass(frozen=True)
class Piece:
    """A run of one tensor's elements inside one rank's slice of a bucket.

    ``tensor`` indexes the layout's tensor list, ``start`` is the first element in the flattened
    tensor, ``offset`` the first element in the rank's slice, ``length`` the number of elements.
    """

    tensor: int
    start: int
    offset: int
    length: int


@dataclass(frozen=True)
class Bucket:
    """Tensors reduced together: their flat concatenation, padded to ``ranks * shard`` elements.

    ``tensors`` are indices into the layout's tensor list, ``offsets`` where each starts in the flat
    buffer, ``length`` the elements they hold, ``shard`` the elements of each rank's slice.
    """

    tensors: Tuple[int, ...]
    offsets: Tuple[int, ...]
    sizes: Tuple[int, ...]
    length: int
    shard: int
    ranks: int

    @property
    def padded(self) -> int:
        """Elements of the flat buffer that is reduce-scattered (``length`` plus zero padding)."""
        return self.shard * self.ranks

    def bounds(self, rank: int) -> Tuple[int, int]:
        """``(start, stop)`` of ``rank``'s slice in the flat buffer, padding excluded."""
        start = min(rank * self.shard, self.length)
        return start, min(start + self.shard, self.length)

    def pieces(self, rank: int) -> List[Piece]:
        """The runs of tensors that lie in ``rank``'s slice, in order."""
        first, last = self.bounds(rank)
        out = []
        for t, offset, size in zip(self.tensors, self.offsets, self.sizes):
            lo, hi = max(first, offset), min(last, offset + size)
            if lo < hi:
                out.append(Piece(tensor=t, start=lo - offset, offset=lo - first, length=hi - lo))
        return out


@dataclass(frozen=True)
class ShardLayout:
    """How the flattened parameters are cut into one slice per rank (the core's plan for a sharded optimizer).

    Tensors of one dtype share buckets (a bucket is one flat buffer); a new bucket starts when the
    next tensor would take the current one past ``bucket_elements``. Each bucket is padded to a
    multiple of ``ranks`` and cut into equal contiguous slices, rank ``r`` owning slice ``r``.

    Example:
        >>> layout = ShardLayout.build(sizes=[6, 4, 3], ranks=2)
        >>> [(b.tensors, b.length, b.shard) for b in layout.buckets]
        [((0, 1, 2), 13, 7)]
        >>> layout.buckets[0].pieces(1)
        [Piece(tensor=1, start=1, offset=0, length=3), Piece(tensor=2, start=0, offset=3, length=3)]
        >>> layout.owned_elements(0), layout.owned_elements(1)
        (7, 6)
    """

    sizes: Tuple[int, ...]
    ranks: int
    buckets: Tuple[Bucket, ...]

    @classmethod
    def build(cls, sizes: Sequence[int], ranks: int, dtypes: Optional[Sequence[str]] = None,
              bucket_elements: Optional[int] = None) -> "ShardLayout":
        """Cut tensors of ``sizes`` elements (and ``dtypes``, default all the same) among ``ranks`` ranks.

        Args:
            sizes: elements of each tensor, in the order the adapter lists its parameters.
            ranks: the number of ranks sharing the state (the process set's size).
            dtypes: dtype name of each tensor; tensors of different dtypes never share a bucket.
            bucket_elements: largest bucket in elements (None: one bucket per dtype). A tensor larger
                than this is a bucket of its own.

        Raises:
            StrategyError: a size below zero, a rank count below one, mismatched lengths, a bad bucket size.
        """
        if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 1:
            raise StrategyError(f"ranks must be an int >= 1 (ranks: {ranks!r})")
        sizes = tuple(sizes)
        for t, size in enumerate(sizes):
            if isinstance(size, bool) or not isinstance(size, int) or size < 0:
                raise StrategyError(f"tensor sizes must be ints >= 0 (tensor {t}: {size!r})")
        kinds = tuple(dtypes) if dtypes is not None else ("",) * len(sizes)
        if len(kinds) != len(sizes):
            raise StrategyError(f"one dtype per tensor is needed (dtypes: {len(kinds)}, tensors: {len(sizes)})")
        if bucket_elements is not None and (isinstance(bucket_elements, bool) or not isinstance(bucket_elements, int)
                                            or bucket_elements < 1):
            raise StrategyError(f"bucket_elements must be None or an int >= 1 (bucket_elements: {bucket_elements!r})")
        groups: Dict[str, List[int]] = {}
        for t, kind in enumerate(kinds):
            groups.setdefault(kind, []).append(t)
        buckets = []
        for members in groups.values():
            for run in _runs(members, sizes, bucket_elements):
                buckets.append(_bucket(run, sizes, ranks))
        return cls(sizes=sizes, ranks=ranks, buckets=tuple(buckets))

    def owned_elements(self, rank: int) -> int:
        """Elements of state ``rank`` keeps (its slices, padding excluded)."""
        total = 0
        for bucket in self.buckets:
            start, stop = bucket.bounds(rank)
            total += stop - start
        return total

    def padded_elements(self) -> int:
        """Elements moved by one reduce-scatter (or one allgather) of every bucket."""
        return sum(bucket.padded for bucket in self.buckets)


def _runs(members: Sequence[int], sizes: Sequence[int], limit: Optional[int]) -> List[List[int]]:
    if limit is None:
        return [list(members)]
    runs: List[List[int]] = [[]]
    filled = 0
    for t in members:
        if runs[-1] and filled + sizes[t] > limit:
            runs.append([])
            filled = 0
        runs[-1].append(t)
        filled += sizes[t]
    return runs


def _bucket(run: Sequence[int], sizes: Sequence[int], ranks: int) -> Bucket:
    offsets, total = [], 0
    for t in run:
        offsets.append(total)
        total += sizes[t]
    shard = -(-total // ranks) if total else 0
    return Bucket(tensors=tuple(run), offsets=tuple(offsets), sizes=tuple(sizes[t] for t in run),
                  length=total, shard=shard, ranks=ranks)


def parameter_signature(entries: Sequence[Tuple[str, Sequence[int], str]]) -> int:
    """A 63-bit digest of (name, shape, dtype) per parameter, for a cross-rank check that all ranks shard the same set.

    Example:
        >>> a = parameter_signature([("w", (2, 3), "float32")])
        >>> a == parameter_signature([("w", (2, 3), "float32")]), a == parameter_signature([("w", (3, 2), "float32")])
        (True, False)
    """
    digest = hashlib.sha256()
    for name, shape, dtype in entries:
        digest.update(f"{name}|{tuple(int(d) for d in shape)}|{dtype};".encode())
    return int.from_bytes(digest.digest()[:8], "big") >> 1


def check_same_parameters(signatures: Sequence[int], counts: Sequence[int]) -> None:
    """Refuse sharding when ranks hold different parameter sets (``signatures``/``counts`` gathered from every rank).

    Raises:
        StrategyError: naming the first rank whose parameters differ from rank 0's.

    Example:
        >>> check_same_parameters([7, 7], [3, 3])
        >>> check_same_parameters([7, 8], [3, 4])
        Traceback (most recent call last):
        ...
        dualframe.errors.StrategyError: a sharded optimizer needs the same parameters (names, shapes, dtypes, order) on every rank; rank 1 differs from rank 0 (parameters: 4 against 3)
    """
    for rank, (signature, count) in enumerate(zip(signatures, counts)):
        if signature != signatures[0] or count != counts[0]:
            raise StrategyError(
                f"a sharded optimizer needs the same parameters (names, shapes, dtypes, order) on every rank; "
                f"rank {rank} differs from rank 0 (parameters: {count} against {counts[0]})"
            )


#: How a sharded optimizer's gradients reach their owners (``DistributedOptimizer(shard=..., scatter=...)``):
#: ``"reducescatter"`` sends each rank only its reduced slice (fewer bytes on a real network);
#: ``"allreduce"`` reduces the whole flat bucket and each rank keeps its slice (Horovod 0.28's
#: allreduce was the faster one on a 2-core box); ``"auto"`` is each adapter's measured choice.
SCATTERS = ("auto", "reducescatter", "allreduce")


def check_scatter(scatter: object, shard: Optional[str]) -> Optional[str]:
    """``scatter`` checked against ``shard`` (a checked shard mode): one of SCATTERS, and only with a shard.

    Returns None when both are unset (a plain optimizer), else the scatter path name ("auto" when unset).

    Example:
        >>> check_scatter(None, "optimizer"), check_scatter("allreduce", "gradients"), check_scatter(None, None)
        ('auto', 'allreduce', None)
        >>> check_scatter("allreduce", None)
        Traceback (most recent call last):
        ...
        dualframe.errors.StrategyError: scatter='allreduce' chooses how a sharded optimizer's gradients are reduced, so it needs shard='optimizer' or 'gradients' (shard: None); drop scatter= or add shard=
    """
    if shard is None:
        if scatter is None:
            return None
        raise StrategyError(f"scatter={scatter!r} chooses how a sharded optimizer's gradients are reduced, so it "
                            f"needs shard='optimizer' or 'gradients' (shard: None); drop scatter= or add shard=")
    if scatter is None:
        return "auto"
    if not isinstance(scatter, str) or scatter.lower() not in SCATTERS:
        raise StrategyError(f"unknown scatter {scatter!r}; choose one of {', '.join(SCATTERS)}")
    return scatter.lower()
