"""Graphs in the advisor, on literal profiles: values live across cuts, stage and checkpoint memory, cut choice.

The graph used throughout (per-sample elements; every node 100 parameters, saves 10, largest 4):

    input(8) -> a -> b -> c -> d -> e       a's output (4) is read by b and, over a skip, by d;
                 \\________ mask(1) ______/   a makes a mask (1) that e reads.

Live across each cut c (the start of node c): c=0 the input 8; c=1 a's output + mask = 5; c=2 a's
output + b's output + mask = 9; c=3 a's output + c's output + mask = 9; c=4 d's output + mask = 5.
A chain would see 8, 4, 4, 4, 4.
"""
import itertools
import json

import pytest

import dualframe
from dualframe import StrategyError
from dualframe.pipeline.partition import partition_ranges
from dualframe.plan import Hardware, LayerProfile, ModelProfile, Training, advise, group_memory, render, to_json
from dualframe.plan.advisor import options
from dualframe.plan.cuts import StageCosts, balance_of, checkpoint_starts, stage_starts
from dualframe.plan.profile import Value

BATCH = 8


def skip_graph(framework: str = "keras") -> ModelProfile:
    layers = [LayerProfile(name, 100, 0, 10.0, 4.0, 4.0) for name in "abcd"] + [LayerProfile("e", 100, 0, 10.0, 2.0, 4.0)]
    values = [Value(-1, 0, 8.0), Value(0, 3, 4.0), Value(0, 4, 1.0), Value(1, 2, 4.0), Value(2, 3, 4.0), Value(3, 4, 4.0)]
    return ModelProfile(framework, "skip", (8,), layers, 8.0, values=values)


def test_live_values_across_each_cut():
    graph = skip_graph()
    assert graph.is_graph
    assert graph.live() == [8.0, 5.0, 9.0, 9.0, 5.0, 0.0]
    as_chain = ModelProfile("keras", "chain", (8,), graph.layers, 8.0)
    assert not as_chain.is_graph
    assert as_chain.live() == as_chain.layer_inputs() + [0.0] == [8.0, 4.0, 4.0, 4.0, 4.0, 0.0]


def test_values_are_validated_and_round_trip_through_json():
    with pytest.raises(StrategyError, match=r"made before it is last read.*\(producer: 2, last_reader: 2"):
        Value(2, 2, 1.0)
    with pytest.raises(StrategyError, match="read by node 9, past the last of 5 nodes"):
        ModelProfile("keras", "bad", (8,), skip_graph().layers, 8.0, values=[Value(0, 9, 1.0)])
    graph = skip_graph()
    assert ModelProfile.from_dict(json.loads(json.dumps(graph.to_dict()))) == graph


def test_a_pipeline_stage_keeps_every_value_that_enters_it():
    # Stage c..e, 4 micro-batches of 2: 9 elements enter per sample (not c's input 4 alone) for all 8
    # rows, plus one micro-batch's 30 saved elements, in float32.
    stage = group_memory(skip_graph(), range(2, 5), Training(BATCH, "sgd"), chunks=4, checkpoint="except_last")
    assert stage.activations == (9 * 8 + 30 * 2) * 4
    assert stage.parameters == stage.gradients == 300 * 4


def test_checkpointed_segments_keep_the_values_live_across_their_starts_once():
    graph, training = skip_graph(), Training(BATCH, "sgd")
    # Segments a-b, c-d, e: kept = input 8 + a's output 4 + b's output 4 + mask 1 = 17, then the
    # largest of the last segment's 10 (held until its backward is done) and the recomputed ones' 20.
    two = group_memory(graph, range(5), training, checkpoint="segments", cuts=[0, 2, 4])
    assert two.activations == (17 + 20) * BATCH * 4
    # Every node its own segment: the mask and a's output cross several cuts but are kept once:
    # 8 + 4 + 1 + 4 + 4 = 21, not 8 + 5 + 9 + 9 = 31.
    each = group_memory(graph, range(5), training, checkpoint="segments", cuts=[0, 1, 2, 3, 4])
    assert each.activations == (21 + 10) * BATCH * 4


def test_the_best_checkpoint_segments_never_keep_more_than_no_checkpointing():
    graph, training = skip_graph(), Training(BATCH, "sgd")
    starts = checkpoint_starts(graph, training)
    assert starts == [0, 1, 2, 3, 4]
    kept = group_memory(graph, range(5), training, checkpoint="segments", cuts=starts).activations
    assert kept == 31 * BATCH * 4 < group_memory(graph, range(5), training).activations == 50 * BATCH * 4
    # One heavy node: nothing to gain, and one segment is what checkpointing becomes.
    heavy = ModelProfile("keras", "one", (8,), [LayerProfile("x", 1, 0, 1.0, 1e6, 1e6), LayerProfile("y", 1, 0, 1.0, 1.0, 1.0)],
                         8.0, values=[Value(-1, 0, 8.0), Value(0, 1, 1e6)])
    assert checkpoint_starts(heavy, training) == [0]


@pytest.mark.parametrize("checkpoint, chunks", [("never", 1), ("except_last", 4), ("always", 8)])
@pytest.mark.parametrize("mixed_precision, replicas", [(False, 1), (True, 3)])
def test_stage_costs_equal_group_memory(checkpoint, chunks, mixed_precision, replicas):
    graph, training = skip_graph(), Training(BATCH, "adam", mixed_precision=mixed_precision)
    costs = StageCosts(graph, training, chunks, checkpoint, replicas)
    for a, b in itertools.combinations(range(6), 2):
        assert costs.total(a, b) == group_memory(graph, range(a, b), training, chunks, checkpoint, replicas).total


def _brute_force(profile, training, stages, chunks, checkpoint):
    """The least memory on the fullest device over every split (the one-process reference)."""
    best = None
    for inner in itertools.combinations(range(1, profile.num_layers), stages - 1):
        starts = [0, *inner]
        worst = max(group_memory(profile, layers, training, chunks, checkpoint).total
                    for layers in partition_ranges(balance_of(starts, profile.num_layers)))
        best = worst if best is None else min(best, worst)
    return best


@pytest.mark.parametrize("stages", [2, 3, 4])
def test_stage_starts_are_the_least_memory_split(stages):
    graph, training = skip_graph(), Training(BATCH, "sgd")
    starts = stage_starts(graph, training, stages, 4, "except_last", slack=1.0)
    worst = max(group_memory(graph, layers, training, 4, "except_last").total
                for layers in partition_ranges(balance_of(starts, 5)))
    assert worst == _brute_force(graph, training, stages, 4, "except_last")


def test_stage_starts_by_hand():
    graph, training = skip_graph(), Training(BATCH, "sgd")
    # Two stages: beginning the second at d costs max(2960, 2112) bytes; at c max(2080, 2992): d.
    # A chain's arithmetic (c's input 4 alone) would have said c.
    assert stage_starts(graph, training, 2, 4, "except_last") == [0, 3]
    assert stage_starts(graph, training, 3, 4, "except_last") == [0, 1, 3]


def test_pipeline_stages_even_out_parameters_within_the_slack():
    # Early nodes: activations (320 KB each at 2 rows per micro-batch); late nodes: weights (160 KB of
    # weights and gradients each), as ResNet-50. Memory alone begins the second stage at early3
    # (968,240 / 968,400 bytes) with every weight on it; within 1.5 x that, late1 (1,448,400 /
    # 481,040 bytes) spreads them: 20,040 / 60,000 parameters.
    layers = [LayerProfile(f"early{j}", 10, 0, 40000.0, 100.0, 100.0) for j in range(4)]
    layers += [LayerProfile(f"late{j}", 20000, 0, 10.0, 10.0, 10.0) for j in range(4)]
    model = ModelProfile("keras", "skewed", (100,), layers, 100.0)
    training = Training(16, "sgd")
    assert stage_starts(model, training, 2, 8, "except_last", slack=1.0) == [0, 3]
    assert stage_starts(model, training, 2, 8, "except_last") == [0, 5]
    # ... but never past what fits.
    assert stage_starts(model, training, 2, 8, "except_last", usable=1.3e6) == [0, 4]


def test_split_points_name_where_stages_begin():
    layers = [LayerProfile(name, 100, 0, 10.0, 4.0, 4.0, split_point=point) for name, point in
              [("conv1", "conv1"), ("layer1.0", "layer1"), ("layer1.1", "layer1.1"), ("layer2.0", "layer2"), ("fc", "fc")]]
    profile = ModelProfile("torch", "resnet", (8,), layers, 8.0, values=skip_graph().values)
    assert profile.split_points([0, 2, 3]) == ["layer1.1", "layer2"]
    assert LayerProfile("dense", 1).split_point == "dense"


def test_report_prints_split_points_for_a_graph_pipeline():
    graph = skip_graph("torch")
    graph = ModelProfile("torch", "skip", (8,), [LayerProfile(l.name, 10**6, 0, l.activations, l.output, l.largest,
                                                              f"blocks.{j}") for j, l in enumerate(graph.layers)],
                         8.0, values=graph.values)
    # 4 MB weights + 4 MB gradients + 8 MB Adam per node: two nodes fit, five do not.
    plan = advise(graph, Training(BATCH), Hardware(40e6 / 0.9, devices_per_node=4, kind="gpu"))
    option = plan.recommended
    assert option.kind == "pipeline" and option.stages == 3
    points = list(graph.split_points([0] + [sum(option.balance[:j]) for j in range(1, 3)]))
    assert list(option.split_points) == points and len(points) == 2
    assert f"split_points={points}" in render(plan)
    assert to_json(plan)["recommended"]["split_points"] == points
    eval(to_json(plan)["recommended"]["strategy"], {"dualframe": dualframe})


def test_graph_checkpointing_row_names_its_segments():
    rows = {o.kind: o for o in options(skip_graph(), Training(BATCH, "sgd"), Hardware(2**30, 2))}
    row = rows["data parallel + checkpointing"]
    assert row.checkpoint == "segments" and row.cuts == (0, 1, 2, 3, 4)
    assert row.split_points == ("b", "c", "d", "e")
    assert row.memory.total <= rows["data parallel"].memory.total
