"""dualframe.pipeline.graph_walk: which values each edge carries, and stages walking GPipe/1F1B along edges (threads)."""
import queue
import threading

import pytest

from dualframe.errors import BalanceError
from dualframe.pipeline.graph import Graph, GraphNode, chain_split, cut_graph
from dualframe.pipeline.graph_walk import edge_pairs, edge_process_sets, edge_values, graph_walk, stage_edges
from dualframe.pipeline.schedule import rank_schedule


def skip_graph():
    """x, mask in; the stem's h0 skips b2 to the join; b1 reads the mask; aux (an output) is made on b1's stage."""
    nodes = (GraphNode("stem", "stem", ("x",), ("h0",)), GraphNode("b1", "b1", ("h0", "mask"), ("h1",)),
             GraphNode("aux", "", ("h1",), ("aux",)), GraphNode("b2", "b2", ("h1",), ("h2",)),
             GraphNode("join", "join", ("h2", "h0"), ("out",)))
    return cut_graph(Graph(("x", "mask"), nodes, ("out", "aux")), split_points=["b1", "b2"])


def test_a_chain_is_a_graph_whose_edges_join_neighbours():
    split = chain_split(4)
    assert edge_pairs(split) == [(0, 1), (1, 2), (2, 3)]
    assert [edge_values(split, j - 1, j) for j in range(1, 4)] == [("x1",), ("x2",), ("x3",)]
    assert [(e.sources, e.targets) for e in (stage_edges(split, 0), stage_edges(split, 3))] == [((), (1,)), ((2,), ())]
    assert split.graph.inputs == ("x0",) and split.graph.outputs == ("x4",) and split.sends[3] == ("x4",)
    assert edge_pairs(chain_split(1)) == []
    with pytest.raises(BalanceError, match=r"a chain needs at least one stage \(stages: 0\)"):
        chain_split(0)


def test_edges_carry_each_value_only_to_its_readers():
    s = skip_graph()
    assert edge_values(s, 0, 1) == ("h0", "mask")
    assert edge_values(s, 0, 2) == ("h0",)           # the skip: not through stage 1
    assert edge_values(s, 1, 2) == ("h1", "aux")     # aux is a model output, for the last stage's loss
    assert [(e.sources, e.targets) for e in map(lambda j: stage_edges(s, j), range(3))] == [
        ((), (1, 2)), ((0,), (2,)), ((0, 1), ())]
    assert edge_pairs(s) == [(0, 1), (0, 2), (1, 2)]
    assert edge_process_sets(s, [[0, 1, 2], [3, 4, 5]]) == [[0, 1], [0, 2], [1, 2], [3, 4], [3, 5], [4, 5]]


class QueueLink:
    """One direction-aware in-memory edge end: messages by tag through shared queues."""

    def __init__(self, boxes, me, peer):
        self.boxes, self.me, self.peer = boxes, me, peer

    def send(self, tag, value):
        self.boxes[(self.me, self.peer, tag)].put(value)

    def receive(self, tag):
        return self.boxes[(self.peer, self.me, tag)].get(timeout=10)


class SumWork:
    """Forward: each message is the set of (stage, micro-batch) cells that fed it; backward mirrors it."""

    def __init__(self, j, edges):
        self.j, self.edges, self.seen = j, edges, {}

    def forward(self, i, received):
        assert (-1 in received) == (self.j == 0)  # the inputs reach stage 0 only
        cells = {(self.j, i)}.union(*[set(v) for k, v in received.items() if k >= 0])
        self.seen[i] = cells
        return {c: frozenset(cells) for c in self.edges.targets}

    def backward(self, i, grads):
        return {p: frozenset({("B", self.j, i)}.union(*[set(g) for g in grads.values()])) for p in self.edges.sources}


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_three_stages_walk_along_edges_without_deadlock(schedule):
    s, m = skip_graph(), 4
    plans = rank_schedule(schedule, 3, m)
    boxes = {}
    for p, c in edge_pairs(s):
        for i in range(m):
            for kind in "FB":
                boxes[(p, c, f"{kind}{i}")] = queue.Queue()
                boxes[(c, p, f"{kind}{i}")] = queue.Queue()
    works, errors = {}, []

    def run(j):
        try:
            edges = stage_edges(s, j)
            links = {peer: QueueLink(boxes, j, peer) for peer in edges.sources + edges.targets}
            works[j] = SumWork(j, edges)
            graph_walk(plans[j], edges, [f"x{i}" for i in range(m)], works[j], links, first=j == 0)
        except Exception as error:  # surfaced below
            errors.append(error)

    threads = [threading.Thread(target=run, args=(j,)) for j in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert not errors and not any(t.is_alive() for t in threads)
    for i in range(m):  # the last stage heard from both earlier stages, directly and through stage 1
        assert works[2].seen[i] == {(0, i), (1, i), (2, i)}
    assert all(q.empty() for q in boxes.values())  # every message sent was received
