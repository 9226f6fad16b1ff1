"""A model that returns its own loss (``output["loss"]``, a mean over rows) split into micro-batches.

The loss of a split over unequal micro-batches (6 rows in 4: 2, 2, 1, 1) is their losses weighted by
rows, equal to the unsplit model's, and so is every gradient (float64, 1e-12); another 0-d output is
still refused, naming it. GPT-2 with ``labels=``: tests/torch/test_hf_split.py and mp_torch_hf.py.
"""
import copy

import pytest
import torch
from torch import nn

import dualframe.torch as hvd
from dualframe.errors import ChunksError, StrategyError
from dualframe.torch.split.loss import model_loss, output_loss


class OwnLoss(nn.Module):
    def __init__(self, total=False):
        super().__init__()
        self.a, self.b, self.total = nn.Linear(4, 4), nn.Linear(4, 1), total

    def forward(self, x, labels):
        y = self.b(torch.tanh(self.a(x)))
        out = {"loss": nn.functional.mse_loss(y, labels), "logits": y}
        if self.total:
            out["total"] = y.sum()
        return out


@pytest.mark.parametrize("strategy", [hvd.ModelParallel, hvd.Pipeline])
def test_the_models_loss_is_the_row_weighted_mean_of_the_micro_batches(strategy):
    torch.manual_seed(0)
    model = OwnLoss().double()
    reference = copy.deepcopy(model)
    x, labels = torch.randn(6, 4, dtype=torch.float64), torch.randn(6, 1, dtype=torch.float64)
    split = strategy(model, split_points=["b"], devices=["cpu", "cpu"], chunks=4)
    loss, expected = split(x, labels=labels)["loss"], reference(x, labels)["loss"]
    assert loss.item() == pytest.approx(expected.item(), abs=1e-12, rel=0)
    loss.backward()
    expected.backward()
    for (n, p), q in zip(split.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-12, rtol=0, msg=n)


def test_another_0d_output_is_still_refused():
    split = hvd.Pipeline(OwnLoss(total=True).double(), split_points=["b"], devices=["cpu", "cpu"], chunks=2)
    with pytest.raises(ChunksError, match="output 'sum_1' is a 0-d tensor"):
        split(torch.randn(4, 4, dtype=torch.float64), torch.randn(4, 1, dtype=torch.float64))


def test_the_loss_is_found_in_a_dict_or_an_attribute_else_refused():
    class Out:
        loss = torch.tensor(2.0)

    assert output_loss(Out()) is Out.loss and output_loss({"loss": 3}) == 3 and output_loss(torch.ones(2)) is None
    with pytest.raises(StrategyError, match=r"the model's output \(tuple\) holds no loss; pass labels among its"):
        model_loss((torch.ones(()),))
