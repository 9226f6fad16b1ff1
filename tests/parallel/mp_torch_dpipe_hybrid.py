"""Hybrid on 4 processes: 2 replicas x 2 stages, against one process training the whole model on the global batch."""
# np: 4
# timeout: 400
import copy

import horovod.torch as horovod
import pytest
import torch
from torch import nn

import dualframe.torch as hvd
from dualframe.rank_schedule import pipeline_process_sets
from dualframe.torch.distributed_pipeline import DistributedPipeline

STEPS, GLOBAL_BATCH = 3, 16


def make_model():
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(5, 12), nn.Tanh(), nn.Linear(12, 12), nn.Tanh(), nn.Linear(12, 2))


@pytest.fixture(scope="module", autouse=True)
def started():
    # The process sets the pipeline needs, declared at start-up: pairs and replicas of each stage.
    hvd.init(process_sets=pipeline_process_sets(4, 2))
    assert hvd.size() == 4


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_hybrid_equals_one_process_on_the_global_batch(schedule):
    model = make_model()
    generator = torch.Generator().manual_seed(5)
    data = [(torch.randn(GLOBAL_BATCH, 5, generator=generator), torch.randn(GLOBAL_BATCH, 2, generator=generator))
            for _ in range(STEPS)]
    reference = copy.deepcopy(model)
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.2)
    pipe = DistributedPipeline(copy.deepcopy(model), balance=[3, 2], chunks=4, schedule=schedule,
                               loss_fn=nn.MSELoss(), data_parallel=2)
    assert (pipe.replica, pipe.stage_index) == divmod(hvd.rank(), 2)
    optimizer = pipe.distributed_optimizer(torch.optim.SGD(pipe.parameters(), lr=0.2))
    rows = GLOBAL_BATCH // 2
    for step, (x, y) in enumerate(data):
        ref_optimizer.zero_grad()
        expected = nn.functional.mse_loss(reference(x), y)
        expected.backward()
        ref_optimizer.step()
        shard = slice(pipe.replica * rows, (pipe.replica + 1) * rows)  # each replica its half of the global batch
        optimizer.zero_grad()
        loss = pipe.train_step(x[shard], y[shard])
        optimizer.step()
        assert loss == pytest.approx(expected.item(), abs=1e-5), f"step {step}"
    merged = {}
    for part in horovod.allgather_object((pipe.replica, pipe.state_dict())):
        if part[0] == 0:
            merged.update(part[1])
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(merged[key], value, atol=1e-5, rtol=0)
    for key, value in pipe.state_dict().items():  # both replicas of a stage hold the same weights
        torch.testing.assert_close(value, reference.state_dict()[key], atol=1e-5, rtol=0)
