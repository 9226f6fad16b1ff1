"""Cutting a model's graph into stages, framework-neutral: where each stage begins and which values cross.

An adapter captures its model (torch.fx, a Keras functional graph) as a ``Graph``: nodes in execution
order, each reading and producing named values. The core decides the cuts and, for every stage, the
values it needs from outside (``reads``) and the values later stages or the caller need from it
(``sends``). A value goes from its producer straight to each stage that reads it, never through a
stage that does not: a skip connection over a stage is one message, not two.

Index names: ``j`` stage, ``n`` stages; ``u`` unit (a top-level module or layer), ``b`` a boundary
between units (the unit index where a stage would begin).
"""
from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from dualframe.errors import BalanceError, SplitPointError
from dualframe.pipeline.partition import balance_by_cost, validate_balance

#: How much more than the best largest-stage cost ``stages=n`` accepts to cut where less crosses.
CUT_SLACK = 0.10


@dataclass(frozen=True)
class GraphNode:
    """One operation of a captured model.

    Args:
        name: unique node id (an fx node name, a Keras layer call).
        scope: dotted path of the module or layer that runs it (torch ``"layer3.0.conv1"``; a functional op
            carries the module whose forward contains it, ``""`` at the root; Keras: the layer name).
        inputs: names of the values it reads.
        outputs: names of the values it produces.
        leaf: it runs a whole module as one piece, so nothing inside ``scope`` can begin a stage.
        unit: the top-level unit it belongs to, which ``balance=`` counts: the outermost module called
            below the model (a ``ModuleList`` is never called, so ``"blocks.3"`` rather than ``"blocks"``);
            None: the first component of ``scope``.
    """

    name: str
    scope: str
    inputs: Tuple[str, ...] = ()
    outputs: Tuple[str, ...] = ()
    leaf: bool = False
    unit: Optional[str] = None

    @property
    def unit_name(self) -> str:
        """``unit``, or the first component of ``scope`` when the adapter gave none."""
        return self.unit if self.unit is not None else self.scope.split(".")[0]


@dataclass(frozen=True)
class Graph:
    """A model as data: its input values, its nodes in execution order, its output values.

    Example:
        >>> g = Graph(("x",), (GraphNode("a", "stem", ("x",), ("h",)),
        ...                    GraphNode("b", "block", ("h",), ("y",)),
        ...                    GraphNode("c", "", ("h", "y"), ("z",))), ("z",))
        >>> [u.name for u in graph_units(g)]
        ['stem', 'block']
    """

    inputs: Tuple[str, ...]
    nodes: Tuple[GraphNode, ...]
    outputs: Tuple[str, ...]

    def __post_init__(self) -> None:
        known = set(self.inputs)
        for node in self.nodes:
            missing = [v for v in node.inputs if v not in known]
            if missing:
                raise SplitPointError(f"node {node.name!r} reads {missing} before any node produces it: "
                                      "nodes must be in execution order")
            known.update(node.outputs)
        unknown = [v for v in self.outputs if v not in known]
        if unknown:
            raise SplitPointError(f"model outputs {unknown} are produced by no node")


@dataclass(frozen=True)
class Unit:
    """A top-level module or layer: the nodes ``start`` to ``stop - 1``; ``balance=`` counts these."""

    name: str
    start: int
    stop: int


def graph_units(graph: Graph) -> List[Unit]:
    """Top-level units in execution order: maximal runs of nodes sharing ``unit_name``.

    Root-scope nodes (a functional op in the model's own forward) join the unit before them, or the
    one after them when none precedes.
    """
    heads = [node.unit_name for node in graph.nodes]
    units: List[Unit] = []
    for k, head in enumerate(heads):
        if units and (head == "" or head == units[-1].name):
            units[-1] = Unit(units[-1].name, units[-1].start, k + 1)
        elif not units and head == "":
            continue
        else:
            start = units[-1].stop if units else 0
            units.append(Unit(head, start, k + 1))
    if not units and graph.nodes:
        units.append(Unit("", 0, len(graph.nodes)))
    return units


@dataclass(frozen=True)
class GraphSplit:
    """A graph cut into stages: what each stage runs, reads and sends.

    Example:
        >>> g = Graph(("h0", "mask"), tuple(
        ...     GraphNode(f"n{k}", f"blocks.{k}", (f"h{k}", "mask"), (f"h{k + 1}",)) for k in range(4)), ("h4",))
        >>> s = cut_graph(g, split_points=["blocks.2"])
        >>> s.reads, s.sends, s.messages(0)
        ((('h0', 'mask'), ('h2', 'mask')), (('h2',), ('h4',)), [('h2', 1)])
    """

    graph: Graph
    starts: Tuple[int, ...]
    split_points: Tuple[str, ...]
    reads: Tuple[Tuple[str, ...], ...] = field(init=False)
    sends: Tuple[Tuple[str, ...], ...] = field(init=False)
    producer: Mapping[str, int] = field(init=False)
    consumers: Mapping[str, Tuple[int, ...]] = field(init=False)

    def __post_init__(self) -> None:
        n, nodes = len(self.starts), self.graph.nodes
        producer: Dict[str, int] = {v: -1 for v in self.graph.inputs}
        readers: Dict[str, List[int]] = {}
        reads: List[List[str]] = [[] for _ in range(n)]
        for j in range(n):
            for node in self.stage_nodes(j):
                for v in node.inputs:
                    if producer[v] != j and v not in reads[j]:
                        reads[j].append(v)
                        readers.setdefault(v, []).append(j)
                for v in node.outputs:
                    producer[v] = j
        for v in self.graph.outputs:
            readers.setdefault(v, []).append(n)
        sends: List[List[str]] = [[] for _ in range(n)]
        for node in nodes:
            for v in node.outputs:
                if readers.get(v) and v not in sends[producer[v]]:
                    sends[producer[v]].append(v)
        object.__setattr__(self, "reads", tuple(tuple(r) for r in reads))
        object.__setattr__(self, "sends", tuple(tuple(s) for s in sends))
        object.__setattr__(self, "producer", producer)
        object.__setattr__(self, "consumers", {v: tuple(js) for v, js in readers.items()})

    @property
    def stages(self) -> int:
        """Number of stages n."""
        return len(self.starts)

    def stage_range(self, j: int) -> range:
        """Node indices of stage ``j``."""
        stop = self.starts[j + 1] if j + 1 < len(self.starts) else len(self.graph.nodes)
        return range(self.starts[j], stop)

    def stage_nodes(self, j: int) -> Tuple[GraphNode, ...]:
        """The nodes stage ``j`` runs, in execution order."""
        r = self.stage_range(j)
        return self.graph.nodes[r.start:r.stop]

    def crossing(self, j: int) -> Tuple[str, ...]:
        """Values live across the boundary between stage ``j`` and ``j + 1`` (produced before, read after)."""
        made = list(self.graph.inputs) + [v for node in self.graph.nodes for v in node.outputs]
        return tuple(v for v in made
                     if self.producer[v] <= j and any(k > j for k in self.consumers.get(v, ())))

    def messages(self, j: int) -> List[Tuple[str, int]]:
        """``(value, stage)`` pairs stage ``j`` sends: each value only to the stages that read it."""
        return [(v, k) for v in self.sends[j] for k in self.consumers[v] if k < self.stages]

    def outputs_from(self, j: int) -> Tuple[str, ...]:
        """The model outputs stage ``j`` produces."""
        return tuple(v for v in self.graph.outputs if self.producer[v] == j)


def chain_split(stages: int) -> GraphSplit:
    """A chain of ``stages`` stages as a graph split: stage j reads ``"x<j>"`` and sends ``"x<j+1>"``, edges (j-1, j).

    One node per stage (the adapter runs the stage's layers as one), so a layer pipeline walks the graph
    walk: the model input is ``"x0"``, its output ``"x<n>"``.

    Example:
        >>> s = chain_split(3)
        >>> s.reads, s.sends, s.split_points
        ((('x0',), ('x1',), ('x2',)), (('x1',), ('x2',), ('x3',)), ('stage1', 'stage2'))
    """
    if stages < 1:
        raise BalanceError(f"a chain needs at least one stage (stages: {stages})")
    nodes = tuple(GraphNode(f"stage{j}", f"stage{j}", (f"x{j}",), (f"x{j + 1}",), leaf=True) for j in range(stages))
    graph = Graph(("x0",), nodes, (f"x{stages}",))
    return GraphSplit(graph, tuple(range(stages)), tuple(f"stage{j}" for j in range(1, stages)))


def stage_count(split_points: Optional[Sequence[str]] = None, balance: Optional[Sequence[int]] = None,
                stages: Optional[int] = None) -> int:
    """How many stages the cut arguments ask for, checked before any model is captured or measured.

    Example:
        >>> stage_count(split_points=["layer3"]), stage_count(balance=[2, 2, 1]), stage_count(stages=4)
        (2, 3, 4)

    Raises:
        BalanceError: not exactly one of the three given, ``stages`` not an int >= 1, a string for
            ``split_points``.
    """
    given = [name for name, value in (("split_points", split_points), ("balance", balance), ("stages", stages))
             if value is not None]
    if len(given) != 1:
        raise BalanceError("give exactly one of split_points=[names], balance=[units per stage] or stages=n "
                           f"(given: {', '.join(given) or 'none'})")
    if stages is not None:
        if isinstance(stages, bool) or not isinstance(stages, int) or stages < 1:
            raise BalanceError(f"stages must be an int >= 1 (stages: {stages!r})")
        return stages
    if split_points is not None:
        if isinstance(split_points, str):
            raise SplitPointError(f"split_points must be a list of names, e.g. ['layer3'] (split_points: {split_points!r})")
        return len(list(split_points)) + 1
    assert balance is not None
    return len(list(balance))


def cut_graph(graph: Graph, *, split_points: Optional[Sequence[str]] = None, balance: Optional[Sequence[int]] = None,
              stages: Optional[int] = None, costs: Optional[Sequence[float]] = None,
              sizes: Optional[Mapping[str, float]] = None) -> GraphSplit:
    """Cut ``graph`` into stages by exactly one of ``split_points``, ``balance`` or ``stages``.

    Args:
        graph: the captured model.
        split_points: names (module paths / layer names) where stages 1..n-1 begin.
        balance: top-level units (``graph_units``) per stage.
        stages: how many stages; the cuts are chosen at unit boundaries, keeping the largest stage cost
            within ``CUT_SLACK`` of the best possible and, among those, the fewest bytes crossing.
        costs: per node, what should be even across stages (seconds, bytes); default 1 each.
        sizes: per value, bytes per sample, to prefer cuts where little crosses; default 1 each.

    Raises:
        SplitPointError: a split point that names nothing, lies inside a leaf module, names a module run
            in several places, is out of execution order, or leaves a stage empty.
        BalanceError: not exactly one way of cutting given, a bad ``balance``, or more stages than units.
    """
    given = [name for name, value in (("split_points", split_points), ("balance", balance), ("stages", stages))
             if value is not None]
    if len(given) != 1:
        raise BalanceError("give exactly one of split_points=[names], balance=[units per stage] or stages=n "
                           f"(given: {', '.join(given) or 'none'})")
    if not graph.nodes:
        raise BalanceError("the model has no operations to split")
    units = graph_units(graph)
    if split_points is not None:
        starts = _starts_of(graph, split_points)
        return GraphSplit(graph, (0, *starts), tuple(split_points))
    if balance is not None:
        counts = validate_balance(balance, len(units))
        firsts = [sum(counts[:j]) for j in range(1, len(counts))]
    else:
        firsts = _choose_cuts(graph, units, stages, costs, sizes)
    return GraphSplit(graph, (0, *(units[u].start for u in firsts)), tuple(units[u].name for u in firsts))


def _starts_of(graph: Graph, split_points: Sequence[str]) -> List[int]:
    if isinstance(split_points, str) or not all(isinstance(p, str) for p in split_points):
        raise SplitPointError(f"split_points must be a list of names, e.g. ['layer3'] (split_points: {split_points!r})")
    starts: List[int] = []
    for index, point in enumerate(split_points):
        start = _start_of(graph, point, f"split_points[{index}]")
        if start == 0:
            raise SplitPointError(f"split point {point!r} ({'split_points'}[{index}]) is where the model begins: "
                                  "stage 0 would be empty; name where stage 1 begins")
        if starts and start <= starts[-1]:
            raise SplitPointError(
                f"split points must follow execution order: {point!r} (split_points[{index}]) runs at operation "
                f"{start}, not after {split_points[index - 1]!r} at operation {starts[-1]}")
        starts.append(start)
    return starts


def _start_of(graph: Graph, point: str, where: str) -> int:
    """Index of the first node of module/layer ``point``; refuses names that cannot begin a stage."""
    inside = [k for k, node in enumerate(graph.nodes) if node.scope == point or node.scope.startswith(point + ".")]
    if not inside:
        for node in graph.nodes:
            if node.leaf and point.startswith(node.scope + "."):
                raise SplitPointError(f"split point {point!r} ({where}) is inside {node.scope!r}, which runs as one "
                                      f"piece; cut before or after {node.scope!r}")
        scopes = sorted({node.scope for node in graph.nodes if node.scope})
        close = difflib.get_close_matches(point, scopes, n=3)
        hint = f"; did you mean {', '.join(map(repr, close))}?" if close else ""
        raise SplitPointError(f"unknown split point {point!r} ({where}): no module or layer of that name runs "
                              f"in the model{hint}")
    if inside != list(range(inside[0], inside[-1] + 1)):
        gap = next(k for k in range(inside[0], inside[-1] + 1) if k not in inside)
        raise SplitPointError(
            f"split point {point!r} ({where}) runs in more than one place (operations {inside[0]}..{inside[-1]}, "
            f"interrupted by {graph.nodes[gap].scope or graph.nodes[gap].name!r}): a module called twice "
            "cannot begin a stage; cut before its first use or after its last")
    return inside[0]


def _crossing_bytes(graph: Graph, units: Sequence[Unit], sizes: Optional[Mapping[str, float]]) -> List[float]:
    """Bytes per sample live across each unit boundary b (index b: before unit b)."""
    last_read: Dict[str, int] = {}
    made_at: Dict[str, int] = {v: -1 for v in graph.inputs}
    for k, node in enumerate(graph.nodes):
        for v in node.inputs:
            last_read[v] = k
        for v in node.outputs:
            made_at[v] = k
    for v in graph.outputs:
        last_read[v] = len(graph.nodes)
    size = (lambda v: float(sizes.get(v, 1.0))) if sizes is not None else (lambda v: 1.0)
    return [sum(size(v) for v, made in made_at.items() if made < unit.start <= last_read.get(v, -1))
            for unit in units]


def _choose_cuts(graph: Graph, units: Sequence[Unit], stages: Optional[int], costs: Optional[Sequence[float]],
                 sizes: Optional[Mapping[str, float]]) -> List[int]:
    """First unit of stages 1..n-1: largest stage cost near the best, then the fewest bytes crossing, then the most even."""
    n = stages
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise BalanceError(f"stages must be an int >= 1 (stages: {stages!r})")
    if n > len(units):
        raise BalanceError(f"cannot make more stages than there are places to cut: {len(units)} top-level units "
                           f"({', '.join(u.name for u in units[:8])}{' ...' if len(units) > 8 else ''}), stages: {n}; "
                           "use split_points= with nested module names for finer cuts")
    node_costs = list(costs) if costs is not None else [1.0] * len(graph.nodes)
    if len(node_costs) != len(graph.nodes):
        raise BalanceError(f"costs must give one value per node (costs: {len(node_costs)}, nodes: {len(graph.nodes)})")
    unit_costs = [float(sum(node_costs[u.start:u.stop])) for u in units]
    best = balance_by_cost(unit_costs, n)
    limit = max(sum(unit_costs[sum(best[:j]):sum(best[:j + 1])]) for j in range(n)) * (1 + CUT_SLACK) + 1e-12
    cross = _crossing_bytes(graph, units, sizes)
    prefix = [0.0]
    for c in unit_costs:
        prefix.append(prefix[-1] + c)
    inf = (float("inf"), float("inf"))
    # least[j][b]: (fewest crossing bytes, then the smallest largest stage cost) for stages 0..j-1 covering
    # units 0..b-1 under the limit; the second breaks ties such as a stack of equal blocks, where the same
    # values cross every boundary and the most even cut is wanted.
    least = [[inf] * (len(units) + 1) for _ in range(n + 1)]
    back = [[0] * (len(units) + 1) for _ in range(n + 1)]
    least[0][0] = (0.0, 0.0)
    for j in range(1, n + 1):
        for b in range(j, len(units) + 1):
            for a in range(j - 1, b):
                if least[j - 1][a] == inf or prefix[b] - prefix[a] > limit:
                    continue
                total = (least[j - 1][a][0] + (cross[a] if a > 0 else 0.0),
                         max(least[j - 1][a][1], prefix[b] - prefix[a]))
                if total < least[j][b]:
                    least[j][b], back[j][b] = total, a
    cuts, b = [], len(units)
    for j in range(n, 0, -1):
        b = back[j][b]
        cuts.append(b)
    return sorted(cuts)[1:]
