"""Weights read by more than one stage (tied, shared): which stages hold each, their ranks, and the order they sum in.

A model may read one weight in two places far apart: GPT-2's output head is its token embedding
(``lm_head.weight`` is ``transformer.wte.weight``), a Keras layer may be called at the start and at the
end. Cut across processes, every stage that reads such a weight holds a copy (as DeepSpeed's
``TiedLayerSpec``): the copies start equal (broadcast from the lowest holding stage), each stage's
backward gives its share of the gradient, and the shares are summed over the holders before the
optimizer step, which then keeps the copies equal. This module decides who holds what and in which
order the sums run (the same on every rank, so no two ranks wait on each other); the adapters find
the weights and run the sums with Horovod.

Index names: ``j`` stage; ``r`` replica.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, Hashable, List, Mapping, Sequence, Tuple, TypeVar

from dualframe.strategy import RankGrid

T = TypeVar("T")


@dataclass(frozen=True)
class TiedWeight:
    """One weight read by several stages.

    Args:
        names: every name the model has for it, in the model's order (``("transformer.wte.weight",
            "lm_head.weight")``); ``names[0]`` keys it.
        stages: the stages that read it, ascending; ``stages[0]`` is the root whose copy the others start from.
    """

    names: Tuple[str, ...]
    stages: Tuple[int, ...]

    @property
    def key(self) -> str:
        """The weight's first name in the model: how every rank refers to it."""
        return self.names[0]

    @property
    def root(self) -> int:
        """The lowest stage holding it: the others' copies start from its copy."""
        return self.stages[0]


def find_tied(stage_weights: Sequence[Sequence[Any]], names: Mapping[Any, Sequence[str]]) -> List[TiedWeight]:
    """The weights that more than one stage reads, ordered by their first name's place in the model.

    Args:
        stage_weights: per stage j, the identities of the weights it reads (any hashable: ``id(tensor)``).
        names: per identity, every name the model has for it, in the model's order.

    Example:
        >>> find_tied([["emb", "w1"], ["w2", "emb"]], {"emb": ["wte", "head"], "w1": ["w1"], "w2": ["w2"]})
        [TiedWeight(names=('wte', 'head'), stages=(0, 1))]
    """
    holders: Dict[Hashable, List[int]] = {}
    for j, weights in enumerate(stage_weights):
        for key in weights:
            if j not in holders.setdefault(key, []):
                holders[key].append(j)
    order = {name: k for k, name in enumerate(n for key in names for n in names[key])}
    tied = [TiedWeight(tuple(names[key]), tuple(sorted(js))) for key, js in holders.items()
            if len(js) > 1 and names.get(key)]
    return sorted(tied, key=lambda w: order[w.key])


def rank_tied(tied: Sequence[TiedWeight], placement: Sequence[int]) -> List[TiedWeight]:
    """The tied weights between ranks: each weight's stages as the rank positions holding them (virtual stages).

    A weight that only stages of one rank read is one variable there, not a copy to keep equal (ZB-V
    puts the first and the last stage, an embedding and its tied head, on rank 0): it leaves the list.

    Example:
        >>> head = TiedWeight(("wte", "head"), (0, 3))
        >>> rank_tied([head], [0, 1, 0, 1]), rank_tied([head], [0, 1, 1, 0])
        ([TiedWeight(names=('wte', 'head'), stages=(0, 1))], [])
    """
    by_rank = [TiedWeight(w.names, tuple(sorted({placement[j] for j in w.stages}))) for w in tied]
    return [w for w in by_rank if len(w.stages) > 1]


def tied_process_sets(tied: Sequence[TiedWeight], grid: RankGrid) -> List[List[int]]:
    """The rank groups that sum tied gradients (one per weight and replica), to declare with the pipeline's own.

    Groups of one rank and the whole world (Horovod's global set) are left out. Declare them at start-up,
    ``hvd.init(process_sets=pipeline_process_sets(size, n, graph=True) + tied_process_sets(...))``, or run
    with ``HOROVOD_DYNAMIC_PROCESS_SETS=1``; two holders are a pair that ``graph=True`` declares already.

    Example:
        >>> tied_process_sets([TiedWeight(("wte", "head"), (0, 2))], RankGrid.build(6, 3))
        [[0, 2], [3, 5]]
    """
    world = grid.replicas * grid.stages
    groups: List[List[int]] = []
    for weight in tied:
        for ranks in grid.pipeline_groups:
            group = [ranks[j] for j in weight.stages]
            if 1 < len(group) < world and group not in groups:
                groups.append(group)
    return groups


@dataclass(frozen=True)
class TiedPlan:
    """What one rank does about tied weights: the ones its stage holds, with their holders' ranks.

    Example:
        >>> plan = TiedPlan.build([TiedWeight(("wte", "head"), (0, 1))], RankGrid.build(4, 2), rank=3)
        >>> [(w.key, plan.ranks(w), plan.root_rank(w)) for w in plan.mine]
        [('wte', (2, 3), 2)]
    """

    tied: Tuple[TiedWeight, ...]
    mine: Tuple[TiedWeight, ...]
    pipeline_ranks: Tuple[int, ...]

    @classmethod
    def build(cls, tied: Sequence[TiedWeight], grid: RankGrid, rank: int) -> "TiedPlan":
        """The plan of ``rank`` (replica r, stage j of ``grid``): the weights stage j holds, in ``tied``'s order."""
        replica, j = grid.position(rank)
        return cls(tuple(tied), tuple(w for w in tied if j in w.stages), tuple(grid.pipeline_groups[replica]))

    def ranks(self, weight: TiedWeight) -> Tuple[int, ...]:
        """The ranks of this pipeline holding ``weight`` (its holders' process set)."""
        return tuple(self.pipeline_ranks[j] for j in weight.stages)

    def root_rank(self, weight: TiedWeight) -> int:
        """The rank of this pipeline whose copy of ``weight`` the others start from."""
        return self.pipeline_ranks[weight.root]


#: ``reduce(tensor, name, ranks)``: the tensor summed over ``ranks`` (a Horovod allreduce on their process set).
Reduce = Callable[[T, str, Tuple[int, ...]], T]


def sum_tied(plan: TiedPlan, tensors: Mapping[str, T], reduce: "Reduce[T]", prefix: str) -> Dict[str, T]:
    """Each tied weight this stage holds summed over its holders, in the plan's order (the same on every holder).

    Args:
        plan: this rank's ``TiedPlan``.
        tensors: per weight key, this stage's share (a gradient); a weight missing here is an error.
        reduce: the framework's sum over a group of ranks.
        prefix: the pipeline's name, so that two pipelines' sums never share a Horovod name.

    Example:
        >>> plan = TiedPlan.build([TiedWeight(("wte", "head"), (0, 1))], RankGrid.build(2, 2), rank=0)
        >>> sum_tied(plan, {"wte": 1.0}, lambda t, name, ranks: t * len(ranks), "dpipe0")
        {'wte': 2.0}
    """
    return {w.key: reduce(tensors[w.key], f"{prefix}.tied.{w.key}", plan.ranks(w)) for w in plan.mine}


def tied_description(tied: Sequence[TiedWeight]) -> List[str]:
    """One line per tied weight for ``describe()``: its names and the stages that read it.

    Example:
        >>> tied_description([TiedWeight(("wte", "head"), (0, 1))])
        ['  tied: wte = head, read by stages 0, 1 (their gradients summed)']
    """
    return [f"  tied: {' = '.join(w.names)}, read by stages {', '.join(map(str, w.stages))} (their gradients summed)"
            for w in tied]
