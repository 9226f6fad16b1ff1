"""Tied weights as data: which stages hold each, the holders' rank groups per replica, the order the sums run in."""
from dualframe.pipeline.tied import TiedPlan, TiedWeight, find_tied, rank_tied, sum_tied, tied_process_sets
from dualframe.strategy import RankGrid

NAMES = {"emb": ["wte", "head"], "w1": ["w1"], "w2": ["w2"], "norm": ["norm"]}


def test_weights_read_by_several_stages_in_the_model_order():
    stages = [["emb", "w1", "norm"], ["w2", "norm"], ["w2", "emb", "emb"]]
    assert find_tied(stages, NAMES) == [TiedWeight(("wte", "head"), (0, 2)), TiedWeight(("w2",), (1, 2)),
                                        TiedWeight(("norm",), (0, 1))]
    assert find_tied([["emb"], ["w1"]], NAMES) == []  # each read by one stage
    assert find_tied([["emb", "emb"], ["w1"]], NAMES) == []  # read twice by one stage: one gradient there


def test_holders_process_sets_per_replica_leave_out_the_world():
    tied = [TiedWeight(("wte", "head"), (0, 2)), TiedWeight(("w2",), (1, 2))]
    assert tied_process_sets(tied, RankGrid.build(6, 3)) == [[0, 2], [3, 5], [1, 2], [4, 5]]
    assert tied_process_sets([TiedWeight(("wte",), (0, 1))], RankGrid.build(2, 2)) == []  # the world: global set
    assert tied_process_sets([TiedWeight(("w",), (0, 1, 3))], RankGrid.build(4, 4)) == [[0, 1, 3]]


def test_each_rank_sums_the_weights_its_stage_holds_in_one_order_over_its_pipeline():
    tied = [TiedWeight(("wte", "head"), (0, 2)), TiedWeight(("w2",), (1, 2))]
    grid = RankGrid.build(6, 3)
    plans = {rank: TiedPlan.build(tied, grid, rank) for rank in range(6)}
    assert [w.key for w in plans[5].mine] == ["wte", "w2"]  # replica 1, stage 2: both, in the model's order
    assert [w.key for w in plans[3].mine] == ["wte"]
    assert [(plans[5].ranks(w), plans[5].root_rank(w)) for w in plans[5].mine] == [((3, 5), 3), ((4, 5), 4)]
    calls = []

    def reduce(value, name, ranks):
        calls.append((name, ranks))
        return value * len(ranks)

    assert sum_tied(plans[5], {"wte": 1, "w2": 3}, reduce, "dpipe7") == {"wte": 2, "w2": 6}
    assert calls == [("dpipe7.tied.wte", (3, 5)), ("dpipe7.tied.w2", (4, 5))]
    assert sum_tied(plans[4], {"w2": 1}, reduce, "dpipe7") == {"w2": 2}


def test_virtual_stages_tie_ranks_not_stages():
    tied = [TiedWeight(("wte", "head"), (0, 3)), TiedWeight(("w2",), (1, 2, 5))]
    # interleaved over 3 ranks (stage j on j % 3): 0 and 3 share rank 0; 1, 2, 5 are on ranks 1, 2, 2
    assert rank_tied(tied, [0, 1, 2, 0, 1, 2]) == [TiedWeight(("w2",), (1, 2))]
    # zb-v over 3 ranks (0 1 2 2 1 0): stages 0 and 3 on ranks 0 and 2; 1, 2, 5 on ranks 1, 2, 0
    assert rank_tied(tied, [0, 1, 2, 2, 1, 0]) == [TiedWeight(("wte", "head"), (0, 2)), TiedWeight(("w2",), (0, 1, 2))]
    assert rank_tied(tied, [0, 1, 2, 3, 4, 5]) == tied  # one stage per rank: as found
