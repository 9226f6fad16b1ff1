"""Virtual stages (several stages per rank): interleaved 1F1B and ZB-V against literal staircases, their
placements, their bubbles against 1F1B's, the clock's checks across ranks by stage index, and the refusals."""
import pytest

from dualframe.errors import BalanceError, ChunksError, ScheduleError
from dualframe.pipeline.action import Action
from dualframe.pipeline.graph import chain_split
from dualframe.pipeline.layout import layout_pipeline
from dualframe.pipeline.link import largest_tag, virtual_tag_offset
from dualframe.pipeline.stage import virtual_process_sets
from dualframe.pipeline.virtual_stage import LocalLink
from dualframe.pipeline.clock import clock_table, peak_live_activations, table_bubble
from dualframe.pipeline.schedule import one_process, rank_schedule, registered, stage_placement
from dualframe.pipeline.virtual import interleaved_1f1b, zb_v


def lists(action_lists):
    return [" ".join(map(str, actions)) for actions in action_lists]


def grid(text):
    """A literal staircase (one line per tick, one column per rank, '.' idle) as a clock table."""
    return [[None if cell == "." else Action.parse(cell) for cell in line.split()] for line in text.strip().splitlines()]


def test_an_action_names_its_stage_and_one_without_runs_on_its_lists_stage():
    assert Action.parse("12W3") == Action("W", 3, stage=12) and str(Action("B", 1, 0)) == "0B1"
    assert Action.parse("F3") == Action("F", 3) and Action("F", 3).on(5) == 5 and Action("F", 3, 1).on(5) == 1
    with pytest.raises(ScheduleError, match=r"\(action: 'xF3'\); on a named stage, the stage first: 2F3"):
        Action.parse("xF3")


def test_interleaved_1f1b_2_ranks_2_virtual_stages_4_micro_batches():
    assert lists(rank_schedule("interleaved-1f1b", 2, 4, virtual_stages=2)) == [
        "0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1 2B2 2B3 0B2 0B3",
        "1F0 1F1 3F0 3B0 3F1 3B1 1F2 1B0 1F3 1B1 3F2 3B2 3F3 3B3 1B2 1B3",
    ]
    assert clock_table(interleaved_1f1b(2, 4, 2)) == grid("""
        0F0 .
        0F1 1F0
        2F0 1F1
        2F1 3F0
        0F2 3B0
        2B0 3F1
        0F3 3B1
        2B1 1F2
        2F2 1B0
        0B0 1F3
        2F3 1B1
        0B1 3F2
        .   3B2
        2B2 3F3
        .   3B3
        2B3 1B2
        0B2 1B3
        0B3 .
    """)


def test_zb_v_2_ranks_4_micro_batches_runs_a_v_with_the_loss_on_rank_0():
    assert lists(zb_v(2, 4)) == [
        "0F0 0F1 0F2 3F0 3B0 3W0 3F1 3B1 3W1 0F3 0B0 0W0 3F2 3B2 3W2 0B1 0W1 3F3 3B3 3W3 0B2 0W2 0B3 0W3",
        "1F0 2F0 1F1 2F1 2B0 2W0 1F2 1B0 1W0 2F2 2B1 2W1 1F3 1B1 1W1 2F3 2B2 2W2 1B2 2B3 1B3 1W2 2W3 1W3",
    ]
    assert clock_table(zb_v(2, 4)) == grid("""
        0F0 .
        0F1 1F0
        0F2 2F0
        3F0 1F1
        3B0 2F1
        3W0 2B0
        3F1 2W0
        3B1 1F2
        3W1 1B0
        0F3 1W0
        0B0 2F2
        0W0 2B1
        3F2 2W1
        3B2 1F3
        3W2 1B1
        0B1 1W1
        0W1 2F3
        3F3 2B2
        3B3 2W2
        3W3 1B2
        0B2 2B3
        0W2 1B3
        0B3 1W2
        0W3 2W3
        .   1W3
    """)


def test_placements_put_stage_j_on_its_rank():
    assert stage_placement("interleaved-1f1b", 3, 2) == [0, 1, 2, 0, 1, 2]
    assert stage_placement("zb-v", 3, 2) == [0, 1, 2, 2, 1, 0]
    assert stage_placement("gpipe", 3) == [0, 1, 2]
    for name, v in (("interleaved-1f1b", 3), ("zb-v", 2)):
        for p in (2, 3, 4):
            placement = stage_placement(name, p, v)
            for r, actions in enumerate(rank_schedule(name, p, 2 * p, v)):
                assert {a.stage for a in actions} == {j for j, rank in enumerate(placement) if rank == r}


@pytest.mark.parametrize("ranks", [2, 3, 4])
def test_both_schedules_finish_for_every_chunks_their_rules_allow(ranks):
    for m in range(1, 13):
        assert clock_table(rank_schedule("zb-v", ranks, m, 2))
        if m % ranks == 0:
            for v in (2, 3):
                assert clock_table(rank_schedule("interleaved-1f1b", ranks, m, v))


def test_the_bubbles_on_the_clock_zb_v_below_half_of_1f1b_interleaved_below_1f1b():
    # One tick is one stage's pass: a virtual stage holds half a rank's layers, so ticks are shorter, but the
    # idle share compares alike (the same work on each rank, spread over more cells).
    one_f_one_b = table_bubble(clock_table(rank_schedule("1f1b", 2, 8)))
    interleaved = table_bubble(clock_table(rank_schedule("interleaved-1f1b", 2, 8, 2)))
    zero_bubble = table_bubble(clock_table(rank_schedule("zb-v", 2, 8, 2)))
    assert round(one_f_one_b, 3) == 0.111 and round(interleaved, 3) == 0.059 and round(zero_bubble, 3) == 0.02
    assert zero_bubble <= one_f_one_b / 2 and interleaved < one_f_one_b


def test_zb_v_holds_no_more_micro_batches_per_rank_than_1f1b_on_its_first_rank():
    # Each virtual stage is half a rank's layers: 2p half-stage activations, p whole ones, as 1F1B's first rank.
    for p in (2, 3, 4):
        for actions in zb_v(p, 3 * p):
            per_stage = {}
            for a in actions:
                per_stage.setdefault(a.stage, []).append(Action(a.kind, a.micro))
            assert sum(peak_live_activations(a, "W") for a in per_stage.values()) <= 2 * p + 1


def test_clock_table_follows_a_micro_batch_across_ranks_by_stage_index():
    # 1F0 on rank 1 must wait for 0F0 on rank 0 even though rank 1's list comes first in reading order.
    table = clock_table([[Action("F", 0, 0), Action("B", 0, 0)], [Action("F", 0, 1), Action("B", 0, 1)]])
    assert table == grid("0F0 .\n. 1F0\n. 1B0\n0B0 .")
    with pytest.raises(ScheduleError, match=r"no rank can move \(rank 0 for 0B0, rank 1 for 1B0; marked \*\)"):
        clock_table([[Action("F", 0, 0), Action("B", 0, 0), Action("F", 0, 2), Action("B", 0, 2)],
                     [Action("F", 0, 1), Action("B", 0, 1)]])


def test_lists_whose_stages_do_not_add_up_are_refused():
    with pytest.raises(ScheduleError, match=r"stage 0 runs on rank 0 and on rank 1; a stage lives on one rank"):
        clock_table([[Action("F", 0, 0), Action("B", 0, 0)], [Action("F", 0, 0), Action("B", 0, 0)]])
    with pytest.raises(ScheduleError, match=r"the stages must be 0..n-1, each on some rank \(stages: \[0, 2\]\)"):
        clock_table([[Action("F", 0, 0), Action("B", 0, 0)], [Action("F", 0, 2), Action("B", 0, 2)]])
    with pytest.raises(ScheduleError, match=r"stage 1 must run F0..F1 and B0..B1 once each \(stage 1: F0 B0\)"):
        clock_table([[Action("F", i, 0) for i in (0, 1)] + [Action("B", i, 0) for i in (0, 1)],
                     [Action("F", 0, 1), Action("B", 0, 1)]])


def test_bad_combinations_are_refused_by_name():
    with pytest.raises(ScheduleError, match=r"schedule '1f1b' runs one stage per rank, so it cannot run "
                                            r"virtual_stages=2; use schedule='interleaved-1f1b' or 'zb-v'"):
        rank_schedule("1f1b", 2, 4, virtual_stages=2)
    with pytest.raises(ChunksError, match=r"interleaved-1f1b needs chunks divisible by the pipeline's ranks.*"
                                          r"\(chunks: 5, ranks: 2\); use chunks=4 or 6"):
        rank_schedule("interleaved-1f1b", 2, 5, virtual_stages=2)
    with pytest.raises(ScheduleError, match=r"interleaved-1f1b needs virtual_stages >= 2 \(virtual_stages: 1\); "
                                            r"with one stage per rank it is schedule='1f1b'"):
        rank_schedule("interleaved-1f1b", 2, 4)
    with pytest.raises(ScheduleError, match=r"zb-v places two stages on each rank.*\(virtual_stages: 3\)"):
        rank_schedule("zb-v", 2, 4, virtual_stages=3)
    with pytest.raises(ScheduleError, match=r"virtual_stages must be an int >= 1.*\(virtual_stages: 0\)"):
        rank_schedule("zb-v", 2, 4, virtual_stages=0)
    with pytest.raises(ScheduleError, match=r"the one-process Pipeline cannot run schedule 'zb-v'"):
        one_process("zb-v")
    assert registered("zb-v").virtual is not None and registered("zb-h1").virtual is None


def test_a_layout_of_virtual_stages_places_them_and_refuses_what_it_cannot_run():
    layout = layout_pipeline(8, [2] * 4, chunks=4, schedule="interleaved-1f1b", world=2, virtual_stages=2)
    assert layout.placement == (0, 1, 0, 1) and layout.held(1) == [1, 3] and layout.virtual_stages == 2
    assert [str(a) for a in layout.actions[1][:3]] == ["1F0", "1F1", "3F0"]
    hybrid = layout_pipeline(8, [2] * 4, chunks=4, schedule="zb-v", world=4, virtual_stages=2)
    assert hybrid.grid.stage_groups == [[0, 2], [1, 3]] and hybrid.held(1) == [1, 2]  # replicas of the V
    taken = layout_pipeline(8, [2] * 4, chunks=4, schedule="zb-v", world=2, virtual_stages=2,
                            checkpoint="except_last")  # each held stage recomputes
    assert taken.recomputed == frozenset({0, 1, 2})
    with pytest.raises(BalanceError, match=r"balance must describe ranks x virtual_stages stages, at least 2 ranks "
                                           r"\(balance: 2 stages, virtual_stages: 2\); give 4 entries"):
        layout_pipeline(8, [4, 4], chunks=4, schedule="zb-v", world=1, virtual_stages=2)
    with pytest.raises(ScheduleError, match=r"schedule 'gpipe' runs one stage per rank"):
        layout_pipeline(8, [4, 4], chunks=4, schedule="gpipe", world=1, virtual_stages=2)
    assert virtual_process_sets(layout_pipeline(6, [1] * 6, 3, "interleaved-1f1b", world=3, virtual_stages=2),
                                chain_split(6)) == [[0, 1], [1, 2], [0, 2]]


def test_stage_named_messages_go_over_their_edges_numbered_apart():
    """``2F3`` on a chain's stage 2: received over edge (1, 2), sent over (2, 3), both tagged ``F3``; a local edge in memory."""
    from dualframe.pipeline.graph_walk import graph_action, stage_edges
    from dualframe.pipeline.walk import StepRecord

    sent = {}

    class Link:
        def __init__(self, edge):
            self.edge = edge

        def send(self, tag, tensor):
            sent[(self.edge, tag)] = tensor

        def receive(self, tag):
            return sent.pop((self.edge, tag))

    class Work:
        def forward(self, i, received):
            self.received = (i, received)
            return {3: "y"}

    work, local = Work(), LocalLink()
    sent[((1, 2), "F3")] = "h"
    graph_action(Action.parse("2F3"), stage_edges(chain_split(4), 2), [], work, {1: Link((1, 2)), 3: local}, False,
                 StepRecord())
    assert work.received == (3, {1: "h"}) and sent == {} and local.receive("F3") == "y"
    offsets = [virtual_tag_offset(b, 4) for b in range(3)]
    assert offsets == [0, 14, 28] and largest_tag(4, links=3) == 41  # block b: 14 numbers, 3 x 4 + agree + loss


def test_a_graph_splits_links_are_its_edges_across_ranks():
    from dualframe.pipeline.graph import Graph, GraphNode, cut_graph
    from dualframe.pipeline.graph_walk import edge_pairs

    nodes = (GraphNode("a", "a", ("x",), ("h0",)), GraphNode("b", "b", ("h0",), ("h1",)),
             GraphNode("c", "c", ("h1", "h0"), ("h2",)), GraphNode("d", "d", ("h2",), ("y",)))
    split = cut_graph(Graph(("x",), nodes, ("y",)), split_points=["b", "c", "d"])
    assert edge_pairs(split) == [(0, 1), (0, 2), (1, 2), (2, 3)]  # h0 skips stage 1
    interleaved = layout_pipeline(4, [1] * 4, 4, "interleaved-1f1b", world=2, virtual_stages=2)
    zero_bubble = layout_pipeline(4, [1] * 4, 4, "zb-v", world=2, virtual_stages=2)
    assert virtual_process_sets(interleaved, split) == [[0, 1]] == virtual_process_sets(zero_bubble, split)
    three = layout_pipeline(6, [1] * 6, 3, "interleaved-1f1b", world=3, virtual_stages=2)
    nodes6 = tuple(GraphNode(n, n, (f"v{k}",), (f"v{k + 1}",)) for k, n in enumerate("abcdef"))
    chain = cut_graph(Graph(("v0",), nodes6, ("v6",)), split_points=["b", "c", "d", "e", "f"])
    assert virtual_process_sets(three, chain) == virtual_process_sets(three, chain_split(6)) == [[0, 1], [1, 2], [0, 2]]
