"""Hybrid of a graph on 4 processes: 2 replicas x 2 stages of a masked encoder, against one process on the global batch.

Each replica's stage 0 sends its stage 1 both the hidden states and the padding mask (one message per
micro-batch); gradients are averaged among the replicas of each stage. With the head reading the
embedding's weight too (tied), both stages hold a copy: averaged over replicas, then summed over holders.
"""
# np: 4
# timeout: 400
import copy

import horovod.torch as horovod
import pytest
import torch
from torch import nn

import dualframe.torch as hvd
from dualframe.pipeline.layout import pipeline_process_sets
from dualframe.torch.pipeline.distributed import DistributedPipeline

STEPS, GLOBAL_BATCH = 3, 16


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.lin = nn.LayerNorm(6), nn.Linear(6, 6)

    def forward(self, h, pad):
        update = torch.tanh(self.lin(self.norm(h))) * (~pad).unsqueeze(-1)
        return h + update


class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(9, 6)
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.head = nn.Linear(6, 2)

    def forward(self, tokens, pad):
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h, pad)
        keep = (~pad).unsqueeze(-1).float()
        return self.head((h * keep).sum(1) / keep.sum(1))


class TiedEncoder(Encoder):
    """The output scaled by a row of the embedding's weight: stage 1 reads the weight stage 0 embeds with."""

    def forward(self, tokens, pad):
        return super().forward(tokens, pad) * self.embed.weight[0, :2]


@pytest.fixture(scope="module", autouse=True)
def started():
    hvd.init(process_sets=pipeline_process_sets(4, 2))  # 2 stages: every edge is a neighbour pair
    assert hvd.size() == 4


@pytest.mark.parametrize("schedule, model_class, checkpoint, shard", [
    ("gpipe", Encoder, "never", None), ("1f1b", Encoder, "never", None), ("zb-h1", Encoder, "never", None),
    ("gpipe", TiedEncoder, "never", None), ("zb-h1", TiedEncoder, "never", None),
    ("zb-h1", TiedEncoder, "always", None), ("1f1b", Encoder, "never", "parameters"),
    ("zb-h1", Encoder, "always", "parameters")])
def test_hybrid_graph_equals_one_process_on_the_global_batch(schedule, model_class, checkpoint, shard):
    """shard="parameters": each replica keeps half of its graph stage between steps (pipe.state_dict() gathers)."""
    torch.manual_seed(3)
    model = model_class()
    g = torch.Generator().manual_seed(5)
    data = []
    for _ in range(STEPS):
        tokens = torch.randint(0, 9, (GLOBAL_BATCH, 5), generator=g)
        pad = torch.zeros(GLOBAL_BATCH, 5, dtype=torch.bool)
        pad[:, 3:] = torch.rand(GLOBAL_BATCH, 2, generator=g) > 0.5
        data.append((tokens, pad, torch.randn(GLOBAL_BATCH, 2, generator=g)))
    reference = copy.deepcopy(model)
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.2)
    pipe = DistributedPipeline(copy.deepcopy(model), chunks=4, schedule=schedule, loss_fn=nn.MSELoss(),
                               data_parallel=2, split_points=["blocks.2"], checkpoint=checkpoint)
    assert [w.stages for w in pipe.tied.plan.tied] == ([(0, 1)] if model_class is TiedEncoder else [])
    edges = pipe.role.edges
    assert (edges.sources, edges.targets) == {0: ((), (1,)), 1: ((0,), ())}[pipe.stage_index]
    optimizer = pipe.distributed_optimizer(torch.optim.SGD(pipe.parameters(), lr=0.2), shard=shard)
    rows = GLOBAL_BATCH // 2
    for step, (tokens, pad, y) in enumerate(data):
        ref_optimizer.zero_grad()
        expected = nn.functional.mse_loss(reference(tokens, pad), y)
        expected.backward()
        ref_optimizer.step()
        half = slice(pipe.replica * rows, (pipe.replica + 1) * rows)
        optimizer.zero_grad()
        loss = pipe.train_step((tokens[half], pad[half]), y[half])
        optimizer.step()
        assert loss == pytest.approx(expected.item(), abs=1e-5), f"step {step}"
        assert shard is None or all(p.untyped_storage().nbytes() == 0 for p in pipe.parameters())
    for key, value in pipe.state_dict().items():  # every replica of a stage holds the one-process weights
        torch.testing.assert_close(value, reference.state_dict()[key], atol=1e-5, rtol=0, msg=key)
    keys = set()
    for part in horovod.allgather_object(list(pipe.state_dict())):
        keys.update(part)
    assert keys == set(reference.state_dict())
