"""ZeRO-3 as data, for both adapters: the blocks gathered as one, each rank's slice of them, gather and prefetch order, the checkpoint layout.

With ``shard="parameters"`` (ZeRO stage 3) a rank keeps 1/N of every parameter, of its gradient and
of its optimizer state. The parameters are grouped into **blocks** (a module / layer gathered as one,
with everything below it): each block's parameters are flattened and cut like one bucket of
``dualframe.dp.shard`` (per dtype, padded to a multiple of N, rank ``r`` owning slice ``r``). Just
before a block's forward and again just before its backward every rank allgathers the block's
slices into the full parameters; after its forward, and after its gradients are reduce-scattered in
backward, the full copy is freed. While block ``b`` runs, the next block (forward: the one that ran
after ``b`` in the first step; backward: the one that ran before it) is already being gathered.

What the core decides here, and the adapters only execute:

- ``block_paths``: which modules/layers are blocks (the rule below), from the model's tree;
- ``ParameterShardPlan``: which parameter belongs to which block, each block's ``ShardLayout`` (so
  which rank owns which elements), the bytes a rank keeps and the bytes one gathered block adds;
- ``GatherOrder``: the forward order of blocks as first run, and which block to prefetch next;
- ``check_unshared``: a parameter held by two blocks is refused (freeing it after one block would
  break the other) before any communication;
- the checkpoint layout: unsharded, one full tensor per parameter name, as the framework's own
  unsharded model saves it (a torch ``state_dict`` / Keras weights). Each rank writes its slice
  from a loaded file with ``Bucket.pieces(rank)``, so a file saved at N ranks loads at any M.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from dualframe.dp.shard import Bucket, ShardLayout
from dualframe.errors import StrategyError

#: The ``shard=`` value of ZeRO-3 (``dualframe.dp.shard.SHARD_MODES`` lists it).
ZERO3 = "parameters"
#: The adapters that run ``shard="parameters"`` (the plan offers ZeRO-3 for these frameworks only).
ZERO3_FRAMEWORKS = ("torch", "keras")


def block_paths(modules: Sequence[Tuple[str, bool]]) -> List[str]:
    """The blocks of a model: the root, and each module reached from it through containers only.

    ``modules`` lists ``(path, is_container)`` for every module below the root, paths dotted
    (``"layers.0.attn"``), a container being a plain list/dict/sequence of modules (torch
    ``Sequential``/``ModuleList``/``ModuleDict``). A module whose parents up to the root are all
    containers is a block and holds its whole subtree (an attention module whose forward reads its
    child projection's weights directly still finds them gathered); the root block (``""``) holds
    the parameters no other block holds. Paths come out in the order given, root first.

    Example:
        >>> block_paths([("embed", False), ("layers", True), ("layers.0", False), ("layers.0.fc", False),
        ...              ("layers.1", False), ("head", False)])
        ['', 'embed', 'layers.0', 'layers.1', 'head']
    """
    containers = {path for path, is_container in modules if is_container}
    out = [""]
    for path, is_container in modules:
        if is_container:
            continue
        parts = path.split(".")
        if all(".".join(parts[:k]) in containers for k in range(1, len(parts))):
            out.append(path)
    return out


def block_of(name: str, blocks: Sequence[str]) -> int:
    """Index in ``blocks`` of the deepest block whose path is a prefix of parameter ``name`` (the root if none).

    Example:
        >>> block_of("layers.0.fc.weight", ["", "layers.0", "head"]), block_of("scale", ["", "head"])
        (1, 0)
    """
    best, depth = 0, -1
    for b, path in enumerate(blocks):
        if path and name.startswith(path + ".") and path.count(".") > depth:
            best, depth = b, path.count(".")
    return best


def check_unshared(holders: Mapping[str, Sequence[str]]) -> None:
    """Refuse a parameter held under several names (shared or tied between modules): blocks free their own.

    Args:
        holders: for each parameter, every name it is reachable under (first the one it is known by).

    Raises:
        StrategyError: naming the parameter's names and the fix.

    Example:
        >>> check_unshared({"a.w": ["a.w"], "b.w": ["b.w"]})
        >>> check_unshared({"embed.weight": ["embed.weight", "head.weight"]})
        Traceback (most recent call last):
        ...
        dualframe.errors.StrategyError: shard='parameters' frees each block's parameters after its forward and backward, so a parameter may belong to one module only (embed.weight is also head.weight); untie it, or use shard='gradients'
    """
    for name, names in holders.items():
        if len(names) > 1:
            also = ", ".join(n for n in names if n != name)
            raise StrategyError(
                f"shard='parameters' frees each block's parameters after its forward and backward, so a parameter "
                f"may belong to one module only ({name} is also {also}); untie it, or use shard='gradients'")


#: The process-pipeline schedules whose stages can shard their parameters among their replicas (one stage per rank).
STAGE_SCHEDULES = ("gpipe", "1f1b", "zb-h1")


def check_stage_sharding(schedule: str, virtual_stages: int) -> None:
    """Refuse ``shard="parameters"`` among a pipeline stage's replicas where a rank would hold several stages.

    A stage holds its gathered parameters from the step's first forward to its last backward, and
    its gradients are reduced once per step: a rank holding several stages (``virtual_stages`` > 1,
    the schedules ``interleaved-1f1b`` and ``zb-v``) is refused, the same on every rank, by name.

    Example:
        >>> check_stage_sharding("1f1b", 1)
        >>> check_stage_sharding("zb-v", 2)
        Traceback (most recent call last):
        ...
        dualframe.errors.StrategyError: shard='parameters' among a pipeline stage's replicas runs one stage per rank with schedule 'gpipe', '1f1b' or 'zb-h1' (schedule: 'zb-v', virtual_stages: 2); use one of those, or shard='gradients'
    """
    if schedule not in STAGE_SCHEDULES or virtual_stages != 1:
        raise StrategyError(
            f"shard='parameters' among a pipeline stage's replicas runs one stage per rank with schedule "
            f"{', '.join(repr(s) for s in STAGE_SCHEDULES[:-1])} or {STAGE_SCHEDULES[-1]!r} (schedule: {schedule!r}, "
            f"virtual_stages: {virtual_stages}); use one of those, or shard='gradients'")


@dataclass(frozen=True)
class Block:
    """One block: its path, the parameters it gathers (indices into the plan's list), their cut among ranks."""

    path: str
    tensors: Tuple[int, ...]
    layout: ShardLayout

    @property
    def gathered_elements(self) -> int:
        """Elements of the block's full, padded flat buffers while it is gathered."""
        return self.layout.padded_elements()


@dataclass(frozen=True)
class ParameterShardPlan:
    """Which block gathers which parameters, and which elements of each block each rank keeps.

    Each block's parameters (in the order given) form a ``ShardLayout`` of their own (one bucket per
    dtype, one slice per rank), so the tensor indices inside ``block.layout`` are positions in
    ``block.tensors``. Blocks without parameters are dropped.

    Example:
        >>> plan = ParameterShardPlan.build(["embed.weight", "layers.0.w", "layers.0.b", "head.w"],
        ...                                 [12, 6, 2, 4], ["", "embed", "layers.0", "head"], ranks=2)
        >>> [(b.path, b.tensors, b.gathered_elements) for b in plan.blocks]
        [('embed', (0,), 12), ('layers.0', (1, 2), 8), ('head', (3,), 4)]
        >>> plan.owned_elements(0), plan.largest_block()
        (12, 12)
    """

    names: Tuple[str, ...]
    ranks: int
    blocks: Tuple[Block, ...]

    @classmethod
    def build(cls, names: Sequence[str], sizes: Sequence[int], blocks: Sequence[str], ranks: int,
              dtypes: Optional[Sequence[str]] = None,
              bucket_elements: Optional[int] = None) -> "ParameterShardPlan":
        """Put each parameter (``names``, ``sizes`` in elements, ``dtypes``) in its block, cut each block among ``ranks``.

        ``bucket_elements`` (None: one bucket per dtype and block) cuts a large block into several
        buckets, as ``ShardLayout.build`` does; a block's buckets are still gathered together.

        Raises:
            StrategyError: mismatched lengths, or what ``ShardLayout.build`` refuses.
        """
        if len(names) != len(sizes) or (dtypes is not None and len(dtypes) != len(sizes)):
            raise StrategyError(f"one name, size and dtype per parameter is needed (names: {len(names)}, "
                                f"sizes: {len(sizes)}, dtypes: {len(dtypes) if dtypes is not None else len(sizes)})")
        members: Dict[int, List[int]] = {}
        for t, name in enumerate(names):
            members.setdefault(block_of(name, blocks), []).append(t)
        out = []
        for b, path in enumerate(blocks):
            tensors = members.get(b, [])
            if not tensors:
                continue
            layout = ShardLayout.build([sizes[t] for t in tensors], ranks,
                                       dtypes=[dtypes[t] for t in tensors] if dtypes is not None else None,
                                       bucket_elements=bucket_elements)
            out.append(Block(path=path, tensors=tuple(tensors), layout=layout))
        return cls(names=tuple(names), ranks=ranks, blocks=tuple(out))

    def owned_elements(self, rank: int) -> int:
        """Parameter elements ``rank`` keeps between blocks (its slices; its gradients and each state slot alike)."""
        return sum(block.layout.owned_elements(rank) for block in self.blocks)

    def largest_block(self) -> int:
        """Elements of the largest gathered block: what a rank holds in full at once, beside its slices."""
        return max((block.gathered_elements for block in self.blocks), default=0)

    def joined(self) -> Tuple[ShardLayout, List[Tuple[int, ...]]]:
        """Every block's buckets in one ``ShardLayout`` (tensors numbered as in ``names``), and each block's buckets.

        For an adapter that keeps one list of slices (Keras): bucket ``k`` of the joined layout is a
        block's bucket unchanged but for its tensor numbers; the second value lists, per block, the
        indices of its buckets in the joined layout.

        Example:
            >>> plan = ParameterShardPlan.build(["a.w", "b.w", "b.b"], [4, 6, 2], ["", "a", "b"], ranks=2)
            >>> layout, owned = plan.joined()
            >>> [b.tensors for b in layout.buckets], owned, layout.owned_elements(1)
            ([(0,), (1, 2)], [(0,), (1,)], 6)
        """
        sizes = [0] * len(self.names)
        buckets: List[Bucket] = []
        owned: List[Tuple[int, ...]] = []
        for block in self.blocks:
            for t, size in zip(block.tensors, block.layout.sizes):
                sizes[t] = size
            first = len(buckets)
            buckets.extend(replace(bucket, tensors=tuple(block.tensors[t] for t in bucket.tensors))
                           for bucket in block.layout.buckets)
            owned.append(tuple(range(first, len(buckets))))
        return ShardLayout(sizes=tuple(sizes), ranks=self.ranks, buckets=tuple(buckets)), owned


def refuse_zero3_only(argument: str, shard: object) -> None:
    """Refuse an argument only ZeRO-3 takes (``model=``, ``keep_gathered=``) given with another ``shard``.

    Example:
        >>> refuse_zero3_only("keep_gathered", "gradients")
        Traceback (most recent call last):
        ...
        dualframe.errors.StrategyError: keep_gathered= is for shard='parameters' (ZeRO-3), which gathers each block's parameters in the model's forward (shard: 'gradients'); drop keep_gathered=
    """
    raise StrategyError(f"{argument}= is for shard='parameters' (ZeRO-3), which gathers each block's parameters "
                        f"in the model's forward (shard: {shard!r}); drop {argument}=")


def check_keep_gathered(keep_gathered: object) -> int:
    """``keep_gathered``, refused unless an int >= 0: how many of the forward's last blocks stay gathered to their backward.

    Example:
        >>> check_keep_gathered(2)
        2
        >>> check_keep_gathered(-1)
        Traceback (most recent call last):
        ...
        dualframe.errors.StrategyError: keep_gathered must be an int >= 0: how many of the forward's last blocks stay gathered until their backward (keep_gathered: -1)
    """
    if isinstance(keep_gathered, bool) or not isinstance(keep_gathered, int) or keep_gathered < 0:
        raise StrategyError(f"keep_gathered must be an int >= 0: how many of the forward's last blocks stay "
                            f"gathered until their backward (keep_gathered: {keep_gathered!r})")
    return keep_gathered


@dataclass
class GatherOrder:
    """The blocks' forward order, recorded in the first forward, and which block to gather ahead.

    Every rank runs the same model, so every rank records the same order and starts the same
    prefetches: the allgathers match by name. Blocks not seen yet have no successor (no prefetch).

    Example:
        >>> order = GatherOrder()
        >>> for b in (0, 2, 1, 0):   # block 0 runs again (an outer block): kept where first seen
        ...     order.seen(b)
        >>> order.order, order.next_forward(2), order.next_backward(2), order.next_backward(0)
        ([0, 2, 1], 1, 0, None)
    """

    order: List[int] = field(default_factory=list)
    _where: Dict[int, int] = field(default_factory=dict)
    settled: bool = False  # a whole step ran: ``order`` holds every block

    def __post_init__(self) -> None:
        self._where = {block: k for k, block in enumerate(self.order)}

    def seen(self, block: int) -> None:
        """Note that ``block`` ran its forward (recorded the first time only)."""
        if block not in self._where:
            self._where[block] = len(self.order)
            self.order.append(block)

    def next_forward(self, block: int) -> Optional[int]:
        """The block to gather while ``block`` runs forward: the one that ran after it."""
        k = self._where.get(block)
        return self.order[k + 1] if k is not None and k + 1 < len(self.order) else None

    def kept(self, block: int, keep: int) -> bool:
        """Whether ``block`` stays gathered from its forward to its backward: one of the last ``keep`` once settled.

        The last blocks of the forward are the first of the backward: freeing one after its forward
        only to gather it again at once costs an allgather per block and saves no memory at the peak.
        Before the order is settled (the first step) every block is freed.

        Example:
            >>> order = GatherOrder(order=[0, 2, 1], settled=True)
            >>> [order.kept(b, 1) for b in (0, 2, 1)], [order.kept(b, 2) for b in (0, 2, 1)], order.kept(1, 0)
            ([False, False, True], [False, True, True], False)
        """
        return self.settled and keep > 0 and block in self.order[-keep:]

    def next_backward(self, block: int) -> Optional[int]:
        """The block to gather while ``block`` runs backward: the one that ran before it."""
        k = self._where.get(block)
        return self.order[k - 1] if k else None
