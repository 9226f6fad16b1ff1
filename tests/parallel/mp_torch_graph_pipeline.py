"""DistributedPipeline of a graph on 3 processes (one stage each): values go straight to the ranks that read them.

The model takes (x, mask), its stem's output skips stage 1's block to the join on stage 2 (edge 0 -> 2),
the mask goes from stage 0 to stage 1 only, and stage 1 makes one of the two outputs (edge 1 -> 2 carries
it to the loss). Training must equal one process training the whole model on the same batches.
"""
# np: 3
# timeout: 400
import copy

import horovod.torch as horovod
import pytest
import torch
from torch import nn

import dualframe.torch as hvd
from dualframe.errors import SplitPointError
from dualframe.pipeline.layout import pipeline_process_sets
from dualframe.torch.pipeline.distributed import DistributedPipeline

STEPS, BATCH, CHUNKS = 3, 10, 4


class Masked(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 6)

    def forward(self, h, mask):
        return torch.tanh(self.lin(h)) * mask.unsqueeze(-1)


class Join(nn.Module):
    def forward(self, a, b):
        return a + b


class SkipModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem, self.b1, self.b2 = nn.Linear(4, 6), Masked(), nn.Linear(6, 6)
        self.join, self.head = Join(), nn.Linear(6, 3)

    def forward(self, x, mask):
        h0 = torch.tanh(self.stem(x))
        h1 = self.b1(h0, mask)
        aux = h1.sum(-1)  # functional code after b1: runs on stage 1, an output sent to the last stage
        out = self.head(self.join(torch.tanh(self.b2(h1)), h0))
        return out, aux


def loss_fn(output, target):
    out, aux = output
    return nn.functional.mse_loss(out, target) + 0.1 * aux.pow(2).mean()


def make_model():
    torch.manual_seed(7)
    return SkipModel()


def batches():
    g = torch.Generator().manual_seed(11)
    return [(torch.randn(BATCH, 4, generator=g), (torch.rand(BATCH, generator=g) > 0.3).float(),
             torch.randn(BATCH, 3, generator=g)) for _ in range(STEPS)]


@pytest.fixture(scope="module", autouse=True)
def started():
    # The neighbour pairs and whole pipeline, plus every skip pair (graph=True): stage 0 sends to stage 2 directly.
    hvd.init(process_sets=pipeline_process_sets(3, 3, graph=True))
    assert hvd.size() == 3


def test_edges_skip_the_stage_that_does_not_read():
    pipe = DistributedPipeline(make_model(), chunks=2, loss_fn=loss_fn, split_points=["b1", "b2"])
    edges = {0: ((), (1, 2)), 1: ((0,), (2,)), 2: ((0, 1), ())}[pipe.stage_index]
    assert (pipe.role.edges.sources, pipe.role.edges.targets) == edges
    with pytest.raises(SplitPointError, match=r"unknown split point 'b3'"):
        DistributedPipeline(make_model(), chunks=2, loss_fn=loss_fn, split_points=["b1", "b3"])


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
@pytest.mark.parametrize("checkpoint", ["never", "always"])
def test_training_equals_one_process(schedule, checkpoint):
    model, data = make_model(), batches()
    reference = copy.deepcopy(model)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    expected = []
    for x, mask, y in data:
        ref_opt.zero_grad()
        loss = loss_fn(reference(x, mask), y)
        loss.backward()
        ref_opt.step()
        expected.append(loss.item())
    pipe = DistributedPipeline(copy.deepcopy(model), chunks=CHUNKS, schedule=schedule, loss_fn=loss_fn,
                               split_points=["b1", "b2"], checkpoint=checkpoint)
    optimizer = torch.optim.SGD(pipe.parameters(), lr=0.1, momentum=0.9)
    for step, (x, mask, y) in enumerate(data):
        optimizer.zero_grad()
        loss = pipe.train_step((x, mask) if pipe.is_first else None, y if pipe.is_last else None)
        assert loss == pytest.approx(expected[step], abs=1e-5), f"step {step}"
        optimizer.step()
    merged = {}
    for part in horovod.allgather_object(pipe.state_dict()):
        merged.update(part)
    assert sorted(merged) == sorted(reference.state_dict())
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(merged[key], value, atol=1e-5, rtol=0, msg=key)


def test_inference_returns_the_model_outputs_on_the_last_stage():
    model = make_model()
    pipe = DistributedPipeline(copy.deepcopy(model), chunks=3, loss_fn=loss_fn, split_points=["b1", "b2"])
    x, mask, _ = batches()[0]
    with torch.no_grad():
        out = pipe((x, mask))
        expected = model(x, mask)
    if pipe.is_last:
        for a, b in zip(out, expected):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
    else:
        assert out is None


class DropoutSkip(SkipModel):
    """Functional dropout records the mode at capture: the pipeline refuses the other mode on every rank."""

    def forward(self, x, mask):
        out, aux = super().forward(x, mask)
        return nn.functional.dropout(out, 0.1, training=self.training), aux


def test_a_mode_dependent_forward_is_refused_in_the_other_mode_on_every_rank():
    from dualframe.errors import StrategyError

    torch.manual_seed(7)
    pipe = DistributedPipeline(DropoutSkip(), chunks=2, loss_fn=loss_fn, split_points=["b1", "b2"])
    x, mask, y = batches()[0]
    pipe.eval()
    with pytest.raises(StrategyError, match=r"captured in training mode .* cannot run in eval mode"):
        pipe((x, mask))
    pipe.train()
    assert pipe.train_step((x, mask) if pipe.is_first else None, y if pipe.is_last else None) > 0
