"""Cutting a graph: units, reads and sends per stage, skip values sent straight to their readers, refusals."""
from __future__ import annotations

import pytest

from dualframe.errors import BalanceError, SplitPointError
from dualframe.pipeline.graph import Graph, GraphNode, cut_graph, graph_units


def resnet_like() -> Graph:
    """stem -> two residual blocks (each: conv1, conv2, add of the block input) -> head; the model also
    returns the stem's features as a second output."""
    nodes = [GraphNode("stem", "stem", ("x",), ("s",))]
    h = "s"
    for b in range(2):
        nodes += [GraphNode(f"c1_{b}", f"layer{b}.0.conv1", (h,), (f"a{b}",)),
                  GraphNode(f"c2_{b}", f"layer{b}.0.conv2", (f"a{b}",), (f"c{b}",)),
                  GraphNode(f"add{b}", f"layer{b}.0", (f"c{b}", h), (f"r{b}",))]
        h = f"r{b}"
    nodes += [GraphNode("flat", "", (h,), ("f",)), GraphNode("fc", "fc", ("f",), ("y",))]
    return Graph(("x",), tuple(nodes), ("y", "s"))


def encoder() -> Graph:
    """(tokens, mask) -> embed -> 3 blocks each reading the mask -> head; attention blocks are leaves."""
    nodes = [GraphNode("embed", "embed", ("tokens",), ("h0",))]
    for k in range(3):
        nodes.append(GraphNode(f"attn{k}", f"blocks.{k}.attn", (f"h{k}", "mask"), (f"a{k}",), leaf=True,
                               unit=f"blocks.{k}"))
        nodes.append(GraphNode(f"add{k}", f"blocks.{k}", (f"a{k}", f"h{k}"), (f"h{k + 1}",), unit=f"blocks.{k}"))
    nodes.append(GraphNode("head", "head", ("h3",), ("y",)))
    return Graph(("tokens", "mask"), tuple(nodes), ("y",))


def test_units_are_top_level_modules_with_root_ops_joining_the_one_before() -> None:
    units = graph_units(resnet_like())
    assert [(u.name, u.start, u.stop) for u in units] == [("stem", 0, 1), ("layer0", 1, 4), ("layer1", 4, 8),
                                                         ("fc", 8, 9)]


def test_split_points_give_reads_sends_and_direct_messages() -> None:
    split = cut_graph(resnet_like(), split_points=["layer1", "fc"])
    assert split.starts == (0, 4, 8)
    assert split.reads == (("x",), ("r0",), ("f",))
    # stage 0 sends the block output to stage 1 and the stem features straight to the caller
    assert split.sends == (("s", "r0"), ("f",), ("y",))
    assert split.messages(0) == [("r0", 1)]
    assert split.outputs_from(0) == ("s",) and split.outputs_from(2) == ("y",)
    assert split.crossing(0) == ("s", "r0")


def test_a_cut_inside_a_residual_block_carries_the_skip_tensor() -> None:
    split = cut_graph(resnet_like(), split_points=["layer0.0.conv2"])
    assert split.reads[1] == ("a0", "s")
    assert split.sends[0] == ("s", "a0")


def test_mask_goes_to_every_stage_that_reads_it_and_nowhere_else() -> None:
    split = cut_graph(encoder(), split_points=["blocks.1", "head"])
    assert split.reads == (("tokens", "mask"), ("h1", "mask"), ("h3",))
    assert split.consumers["mask"] == (0, 1)
    assert split.messages(1) == [("h3", 2)]


def test_balance_counts_units() -> None:
    split = cut_graph(encoder(), balance=[2, 3])
    assert split.split_points == ("blocks.1",) and split.starts == (0, 3)
    with pytest.raises(BalanceError, match="sum"):
        cut_graph(encoder(), balance=[2, 2])


def test_stages_balances_cost_then_prefers_small_crossings() -> None:
    # equal costs: the best largest stage is 2 of 5 units (or 3 within the slack); between the cut
    # candidates within the limit, the one where the mask does not also cross wins when it is large
    g = encoder()
    costs = [1.0] * len(g.nodes)
    split = cut_graph(g, stages=2, costs=costs)
    assert split.stages == 2
    loads = [sum(costs[k] for k in split.stage_range(j)) for j in range(2)]
    assert max(loads) <= 5
    heavy = cut_graph(g, stages=2, costs=[1.0, 1, 1, 1, 1, 1, 1, 1], sizes={"h1": 100.0, "h2": 1.0, "mask": 1.0})
    assert heavy.split_points == ("blocks.2",)


def test_refusals_name_the_value() -> None:
    g = encoder()
    with pytest.raises(SplitPointError, match=r"unknown split point 'block.1'.*did you mean 'blocks.1'"):
        cut_graph(g, split_points=["block.1"])
    with pytest.raises(SplitPointError, match=r"inside 'blocks.0.attn', which runs as one piece"):
        cut_graph(g, split_points=["blocks.0.attn.out_proj"])
    with pytest.raises(SplitPointError, match="follow execution order"):
        cut_graph(g, split_points=["blocks.2", "blocks.1"])
    with pytest.raises(SplitPointError, match="stage 0 would be empty"):
        cut_graph(g, split_points=["embed"])
    with pytest.raises(BalanceError, match="more stages than there are places to cut"):
        cut_graph(g, stages=6)
    with pytest.raises(BalanceError, match="exactly one"):
        cut_graph(g, stages=2, balance=[2, 3])


def test_a_module_called_twice_cannot_begin_a_stage() -> None:
    nodes = (GraphNode("a", "shared", ("x",), ("h",)), GraphNode("b", "mid", ("h",), ("k",)),
             GraphNode("c", "shared", ("k",), ("y",)))
    with pytest.raises(SplitPointError, match="runs in more than one place"):
        cut_graph(Graph(("x",), nodes, ("y",)), split_points=["shared"])
    assert cut_graph(Graph(("x",), nodes, ("y",)), split_points=["mid"]).reads[1] == ("h",)


def test_nodes_out_of_order_are_refused() -> None:
    with pytest.raises(SplitPointError, match="execution order"):
        Graph(("x",), (GraphNode("a", "a", ("h",), ("y",)),), ("y",))
