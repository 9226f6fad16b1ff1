"""The stage walk's records and the pipeline bubble: pure logic, one process."""
import pytest

from dualframe.errors import StrategyError
from dualframe.pipeline.walk import RecordBook, StepRecord, pipeline_bubble, read_agreement, step_agreement
from dualframe.pipeline.clock import gpipe_bubble


def gpipe_two_stages(m: int, forward: float, backward: float):
    """Hand-derived GPipe timings of 2 stages (stage 1 computes the loss at once): (busy, wall) per stage."""
    # Stage 0 runs F0..F{m-1} back to back; stage 1 runs F_i once F_i arrived and its previous action ended,
    # then B{m-1}..B0; stage 0's B_i waits for stage 1's B_i.
    end1 = 0.0
    for i in range(m):
        end1 = max(end1, (i + 1) * forward) + forward
    end0 = m * forward
    for _ in range(m):
        end1 += backward
        end0 = max(end0, end1) + backward
    busy = m * (forward + backward)
    return [busy, busy], [end0, end1]


@pytest.mark.parametrize("m", [1, 2, 4, 8, 16])
def test_pipeline_bubble_is_gpipes_formula_when_a_backward_costs_two_forwards(m):
    busy, walls = gpipe_two_stages(m, forward=1.0, backward=2.0)
    assert pipeline_bubble(busy, walls) == pytest.approx(gpipe_bubble(stages=2, chunks=m))
    # Each stage's own figure misses the last stage's idle tail: below the formula for few micro-batches.
    own = sum(1 - b / w for b, w in zip(busy, walls)) / 2
    assert own < gpipe_bubble(stages=2, chunks=m) - (0.05 if m <= 2 else 0.0)


def test_pipeline_bubble_refuses_mismatched_or_empty_figures():
    with pytest.raises(StrategyError, match="one busy and one step figure per stage"):
        pipeline_bubble([1.0], [1.0, 2.0])
    with pytest.raises(StrategyError, match="one busy and one step figure per stage"):
        pipeline_bubble([], [])
    with pytest.raises(StrategyError, match="longer than 0 s"):
        pipeline_bubble([0.0, 0.0], [0.0, 0.0])


def test_record_book_leaves_out_the_first_step():
    book = RecordBook(keep=3)
    book.add(StepRecord(0.0, 10.0, [("F0", 0.0, 1.0)]))
    for _ in range(3):
        book.add(StepRecord(0.0, 4.0, [("F0", 0.0, 1.0), ("B0", 2.0, 3.0)]))
    assert len(book.records) == 3
    assert (book.mean_wall(), book.mean_busy(), book.mean_bubble()) == (4.0, 2.0, 0.5)


class _Log:
    """A fake graph stage work and edge links that log every call (values are the tags)."""

    def __init__(self):
        self.calls = []

    def forward(self, i, received):
        self.calls.append(f"forward {i}")
        return {}  # the last stage sends nothing on

    def backward(self, i, grads):
        self.calls.append(f"backward {i}")
        return {0: f"dx{i}"}

    def weight(self, i):
        self.calls.append(f"weight {i}")

    def receive(self, tag):
        self.calls.append(f"receive {tag}")
        return tag

    def send(self, tag, tensor):
        self.calls.append(f"send {tag}")


def test_walk_runs_w_as_the_weights_gradient_on_the_stage_without_messages():
    """A chain's last stage (edges j - 1 -> j) under ZB-H1: W computes, sends and receives nothing."""
    from dualframe.pipeline.graph import chain_split
    from dualframe.pipeline.graph_walk import graph_walk, stage_edges
    from dualframe.pipeline.schedule import zb_h1

    log = _Log()
    record = graph_walk(zb_h1(2, 2)[1], stage_edges(chain_split(2), 1), [], log, {0: log}, first=False)
    assert log.calls == [
        "receive F0", "forward 0", "backward 0", "send B0",
        "receive F1", "forward 1", "backward 1", "send B1", "weight 0", "weight 1",
    ]
    assert [tag for tag, _, _ in record.actions] == ["F0", "B0", "F1", "B1", "W0", "W1"]


def test_a_model_computing_its_own_loss_needs_no_targets_and_refuses_them():
    def summed(first, last):
        return [a + b for a, b in zip(first, last)]

    first = step_agreement((6, 8), 3, None, first=True, last=False)
    without = summed(first, step_agreement(None, 0, 0, first=False, last=True))
    assert read_agreement(without, 3, need_targets=False, own_loss=True) == ((6, 8), 3, [2, 2, 2])
    with pytest.raises(StrategyError, match="got targets=None; pass the targets there"):
        read_agreement(summed(first, step_agreement(None, 0, None, first=False, last=True)), 3, need_targets=True)
    given = summed(first, step_agreement(None, 0, 6, first=False, last=True))
    with pytest.raises(StrategyError, match=r"the last stage got targets, but the loss is the model's own"):
        read_agreement(given, 3, need_targets=False, own_loss=True)
