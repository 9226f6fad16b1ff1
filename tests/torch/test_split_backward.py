"""The backward split in two (B: input gradient, W: weight gradient) against one plain backward, in one process:
SplitBackward on its own, and whole ZB-H1 steps of a chain's stage works (TorchGraphStageWork over ChainPart's
split) run in the clock table's order."""
import copy

import pytest
import torch
from torch import nn

from dualframe.pipeline.clock import clock_table
from dualframe.pipeline.schedule import rank_schedule, stage_placement
from dualframe.torch.pipeline.activation_meter import ActivationMeter
from dualframe.torch.graph.chain import ChainPart, ChainStage
from dualframe.torch.pipeline.graph_work import TorchGraphStageWork, pack, unpack
from dualframe.torch.pipeline.backward import SplitBackward
from dualframe.testing.one_process import walk_in_one_process


class Scaled(nn.Module):
    """Owns a parameter and a child that owns others: its W walks through the child's ops again."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(1.5))
        self.inner = nn.Linear(6, 6)

    def forward(self, x):
        return self.inner(x * self.scale), x  # a tuple: the second output needs no gradient of its own


class Pick(nn.Module):
    def forward(self, pair):
        return pair[0] + 0.1 * pair[1]


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.ReLU(inplace=True), Scaled(), Pick(), nn.LayerNorm(6), nn.Linear(6, 3))


def test_b_then_w_give_the_gradients_of_one_backward():
    model, reference = make_model(), make_model()
    x = torch.randn(5, 4)
    grad = torch.randn(5, 3)
    xr = x.clone().requires_grad_()
    reference(xr).backward(grad)

    split = SplitBackward(model)
    xs = x.clone().requires_grad_()
    with split.recording(0):
        y = model(xs)
    (grad_x,) = split.input_pass(0, [y], [grad], [xs])
    assert all(p.grad is None for p in model.parameters())  # B computed no weight gradient
    torch.testing.assert_close(grad_x, xr.grad, rtol=0, atol=1e-6)
    fired = []
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda p: fired.append(p))
    split.weight_pass(0)
    assert len(fired) == len(list(model.parameters()))  # autograd accumulated: DistributedOptimizer's hooks fire
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=1e-6)
    split.close()


def run_pipeline(schedule, stages, chunks, x, y):
    """Every stage of a DistributedPipeline's work in one process, actions run in the clock table's order."""
    model = make_model()
    cuts = [(0, 2), (2, 4), (4, 6)] if stages == 3 else [(0, 4), (4, 6)]
    parts = [nn.Sequential(*list(model)[a:b]) for a, b in cuts]
    lists = rank_schedule(schedule, stages, chunks)
    xs, ys = list(x.chunk(chunks)), list(y.chunk(chunks))
    weights = [len(t) / len(x) for t in xs]
    chain = ChainPart(stages)
    works = [TorchGraphStageWork(ChainStage(part), chain.split, j, chain.unflatten, torch.device("cpu"), nn.MSELoss(),
                                 ys if j == stages - 1 else [], weights, ActivationMeter(part.parameters()),
                                 SplitBackward(part) if schedule == "zb-h1" else None) for j, part in enumerate(parts)]
    messages = {}
    for row in clock_table(lists):
        for j, action in enumerate(row):
            if action is None:
                continue
            i = action.micro
            if action.kind == "F":
                received = {-1: {chain.input: xs[i]}} if j == 0 else {j - 1: messages[("F", i, j)]}
                messages[("F", i, j + 1)] = works[j].forward(i, received).get(j + 1)
            elif action.kind == "B":
                grads = {j + 1: messages[("B", i, j)]} if j < stages - 1 else {}
                messages[("B", i, j - 1)] = works[j].backward(i, grads).get(j - 1)
            else:
                works[j].weight(i)
    return model, works[-1].loss_sum


@pytest.mark.parametrize("stages, chunks", [(2, 4), (3, 4)])
def test_a_zb_h1_step_equals_a_1f1b_step_and_the_plain_model(stages, chunks):
    torch.manual_seed(1)
    x, y = torch.randn(16, 4), torch.randn(16, 3)
    zb, zb_loss = run_pipeline("zb-h1", stages, chunks, x, y)
    ofob, ofob_loss = run_pipeline("1f1b", stages, chunks, x, y)
    plain = make_model()
    loss = nn.MSELoss()(plain(x), y)
    loss.backward()
    assert zb_loss == pytest.approx(float(loss), abs=1e-6) and ofob_loss == pytest.approx(float(loss), abs=1e-6)
    for a, b, c in zip(zb.parameters(), ofob.parameters(), plain.parameters()):
        torch.testing.assert_close(a.grad, c.grad, rtol=0, atol=1e-5)
        torch.testing.assert_close(b.grad, c.grad, rtol=0, atol=1e-5)


def run_virtual(schedule, chunks, x, y):
    """A 2-rank schedule of 4 stages in one process, each rank's stages handing their values over in memory."""
    model = make_model()
    cuts, ranks = [(0, 2), (2, 3), (3, 5), (5, 6)], 2
    placement = stage_placement(schedule, ranks, 2)
    xs, ys = list(x.chunk(chunks)), list(y.chunk(chunks))
    chain = ChainPart(4)
    works = [TorchGraphStageWork(ChainStage(nn.Sequential(*list(model)[a:b])), chain.split, j, chain.unflatten,
                                 torch.device("cpu"), nn.MSELoss(), ys if j == 3 else [], [len(t) / len(x) for t in xs],
                                 ActivationMeter(model.parameters()), SplitBackward(model[a:b]) if schedule == "zb-v"
                                 else None, local=frozenset(k for k in range(4) if placement[k] == placement[j]))
             for j, (a, b) in enumerate(cuts)]
    walk_in_one_process(rank_schedule(schedule, ranks, chunks, virtual_stages=2), chain.split, dict(enumerate(works)),
                        [{chain.input: t} for t in xs])
    return model, works[-1].loss_sum


@pytest.mark.parametrize("schedule", ["zb-v", "interleaved-1f1b"])
def test_virtual_stages_equal_the_plain_model_with_a_rank_s_stages_handed_over_in_memory(schedule):
    torch.manual_seed(1)
    x, y = torch.randn(16, 4), torch.randn(16, 3)
    model, loss_sum = run_virtual(schedule, 4, x, y)
    plain = make_model()
    loss = nn.MSELoss()(plain(x), y)
    loss.backward()
    assert loss_sum == pytest.approx(float(loss), abs=1e-6)
    for a, c in zip(model.parameters(), plain.parameters()):
        torch.testing.assert_close(a.grad, c.grad, rtol=0, atol=1e-5)


def test_a_message_between_two_stages_of_one_rank_is_the_values_themselves():
    model = make_model()
    chain, cpu = ChainPart(4), torch.device("cpu")
    one, two = (TorchGraphStageWork(ChainStage(model[a:b]), chain.split, j, chain.unflatten, cpu, nn.MSELoss(), [],
                                    [1.0], ActivationMeter(model.parameters()), local=frozenset({1, 2}))
                for j, (a, b) in ((1, (2, 3)), (2, (3, 5))))
    sent = one.forward(0, {0: pack([torch.randn(5, 6)], ["x1"], cpu)})[2]
    assert isinstance(sent, list) and isinstance(sent[0], tuple)  # Scaled's pair, not a packed byte message
    assert not any(t.requires_grad for t in sent[0])  # detached: stage 2's own leaves, stage 1's graph its own
    two.forward(0, {1: sent})
    back = two.backward(0, {3: pack([torch.ones(5, 6)], ["x3"], cpu)})[1]
    assert isinstance(back, list) and [t.shape for t in back[0]] == [(5, 6), (5, 6)]
    one.backward(0, {2: back})
    assert model[2].scale.grad is not None


def test_a_message_carries_a_value_of_several_tensors():
    pair = (torch.randn(2, 3), torch.arange(4))
    got = unpack(pack([pair], ["x1"], torch.device("cpu")))[0]
    assert isinstance(got, tuple) and all(torch.equal(a, b) for a, b in zip(got, pair))


def test_a_parameter_used_outside_a_module_call_gets_its_gradient_in_b():
    class Bare(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(4, 4))
            self.lin = nn.Linear(4, 4)

        def forward(self, x):  # self.w is this module's own: its hook fires, after self.lin's
            return self.lin(x @ self.w)

    torch.manual_seed(0)
    model = Bare()
    reference = copy.deepcopy(model)
    x = torch.randn(3, 4)
    reference(x).sum().backward()
    split = SplitBackward(model.lin)  # only the Linear is hooked: self.w is "outside"
    split.parameters.append(model.w)
    with split.recording(0):
        out = model(x).sum()
    split.input_pass(0, [out], [None], [])
    torch.testing.assert_close(model.w.grad, reference.w.grad)
    assert model.lin.weight.grad is None
    split.weight_pass(0)
    torch.testing.assert_close(model.lin.weight.grad, reference.lin.weight.grad)


def linears():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 6, bias=False), nn.Linear(6, 3))


@pytest.mark.parametrize("hooked", [False, True])
def test_w_of_linears_equals_one_backward_per_micro_batch_with_or_without_a_hook(hooked):
    """A plain Linear's W is two products added into .grad (by autograd's accumulator where a hook watches it)."""
    model, reference = linears(), linears()
    xs, grads = torch.randn(2, 5, 2, 4), torch.randn(2, 5, 2, 3)  # 3-d inputs: the products run over every row
    for x, grad in zip(xs, grads):
        reference(x).backward(grad)
    fired = []
    if hooked:
        model[2].weight.register_post_accumulate_grad_hook(lambda p: fired.append(p))
    split = SplitBackward(model)
    for i, x in enumerate(xs):
        with split.recording(i):
            y = model(x.clone().requires_grad_())
        split.input_pass(i, [y], [grads[i]], [])
    for i in range(len(xs)):
        split.weight_pass(i)
    assert len(fired) == (2 if hooked else 0)  # once per micro-batch: through autograd
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-6)


def test_w_refuses_a_linear_input_changed_in_place_after_its_forward():
    model = linears()
    split = SplitBackward(model)
    with split.recording(0):
        hidden = model[:2](torch.randn(5, 4))
        y = model[2:](hidden)
    split.input_pass(0, [y], [torch.ones(5, 3)], [])
    with torch.no_grad():
        hidden.add_(1.0)  # the second Linear's input, after its B: its weights' gradient would be wrong
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        split.weight_pass(0)
