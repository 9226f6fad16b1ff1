"""Hybrid within a node on 2 ranks: each rank splits its model over two devices, gradients averaged across ranks.

Every rank runs every test. The one-process reference is computed inside each rank: the same initial
model (seed 0) trained on the whole global batch. Devices are omitted, so each rank takes its share
of the visible accelerators (here none: "cpu" for both groups).
"""

import horovod.torch as horovod
import pytest
import torch
from torch import nn

import dualframe.torch as hvd

TOL = 1e-6
ROWS = 6  # rows per rank; the global batch has ROWS * size rows


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 2)).double()


def global_batch(step):
    generator = torch.Generator().manual_seed(100 + step)
    x = torch.randn(ROWS * hvd.size(), 5, generator=generator, dtype=torch.float64)
    return x, torch.randn(ROWS * hvd.size(), 2, generator=generator, dtype=torch.float64)


def shard(tensor):
    return tensor[hvd.rank() * ROWS:(hvd.rank() + 1) * ROWS]


def test_model_parallel_gradients_averaged_equal_the_global_batch():
    hvd.init()
    assert hvd.size() == 2
    split = hvd.ModelParallel(model(), [2, 3])
    assert [str(d) for d in split.devices] == ["cpu", "cpu"]
    reference = model()
    x, y = global_batch(0)
    nn.functional.mse_loss(split(shard(x)), shard(y)).backward()
    for index, p in enumerate(split.parameters()):
        p.grad = hvd.allreduce(p.grad, op=hvd.Average, name=f"split.grad.{index}")
    nn.functional.mse_loss(reference(x), y).backward()
    for p, r in zip(split.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, r.grad, atol=TOL, rtol=0)


@pytest.mark.parametrize("checkpoint", ["except_last", "never"])
def test_pipeline_with_distributed_optimizer_trains_like_one_process(checkpoint):
    hvd.init()
    pipe = hvd.Pipeline(model(), [3, 2], chunks=3, checkpoint=checkpoint)
    reference = model()
    wrapper = getattr(hvd, "DistributedOptimizer", None) or horovod.DistributedOptimizer
    optimizer = wrapper(torch.optim.SGD(pipe.parameters(), lr=0.1, momentum=0.9),
                        named_parameters=[(f"{checkpoint}.{n}", p) for n, p in pipe.named_parameters()])
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    for step in range(3):
        x, y = global_batch(step)
        optimizer.zero_grad()
        nn.functional.mse_loss(pipe(shard(x)), shard(y)).backward()
        optimizer.step()
        ref_optimizer.zero_grad()
        nn.functional.mse_loss(reference(x), y).backward()
        ref_optimizer.step()
    for p, r in zip(pipe.parameters(), reference.parameters()):
        torch.testing.assert_close(p.detach(), r.detach(), atol=TOL, rtol=0)
    # the ranks hold the same weights, as one model
    flat = torch.cat([p.detach().reshape(-1) for p in pipe.parameters()])
    torch.testing.assert_close(hvd.allreduce(flat, op=hvd.Max, name=f"{checkpoint}.max"), flat, atol=0, rtol=0)
