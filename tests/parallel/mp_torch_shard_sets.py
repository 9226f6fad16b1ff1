"""The sharded optimizer on 4 ranks (oversubscribed): slices of a quarter, and two process sets of 2 ranks each.

Every rank runs every test; each compares with a one-process reference computed inside the rank.
"""
# np: 4
# launchers: mpirun
import pytest
import torch

import dualframe.torch as hvd
import dualframe.torch.dp.shard.optimizer as shard_module
from torch_cases import make_residual  # tests/parallel is on sys.path (pytest rootdir import)

TOL = 1e-5
PAIRS = [hvd.ProcessSet([0, 1]), hvd.ProcessSet([2, 3])]


@pytest.fixture(scope="module", autouse=True)
def started():
    hvd.init(process_sets=PAIRS)
    assert hvd.size() == 4


def adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)


def batches(seed, steps=4, rows=8):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(rows, 6, generator=g), torch.randn(rows, 3, generator=g)) for _ in range(steps)]


def reference(data):
    model = make_residual(0)
    optimizer = adamw(model)
    for x, y in data:
        optimizer.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        optimizer.step()
    return model, optimizer


def train(data, process_set, shard):
    model = make_residual(hvd.rank())
    optimizer = hvd.DistributedOptimizer(adamw(model), model.named_parameters(), shard=shard, process_set=process_set)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)  # the same start on all 4 ranks
    n, r = process_set.size(), process_set.rank()
    for x, y in data:
        optimizer.zero_grad()
        rows = slice(r * len(x) // n, (r + 1) * len(x) // n)
        ((model(x[rows]) - y[rows]) ** 2).mean().backward()
        optimizer.step()
    return model, optimizer


@pytest.mark.parametrize("shard", ["optimizer", "gradients"])
def test_quarter_slices_equal_one_process(shard, monkeypatch):
    monkeypatch.setattr(shard_module, "BUCKET_ELEMENTS", 25)  # several buckets, uneven quarters
    data = batches(1)
    model, optimizer = train(data, hvd.global_process_set, shard)
    expected, ref_optimizer = reference(data)
    assert optimizer.ranks == 4 and len(optimizer._slots) > 3
    for p, q in zip(model.parameters(), expected.parameters()):
        assert torch.allclose(p, q, atol=TOL)
    full = optimizer.state_dict()
    for i, entry in ref_optimizer.state_dict()["state"].items():
        assert torch.allclose(full["state"][i]["exp_avg_sq"], entry["exp_avg_sq"], atol=TOL)


def test_two_process_sets_each_shard_among_their_pair():
    pair = PAIRS[hvd.rank() // 2]
    data = batches(10 + hvd.rank() // 2)  # each pair its own data
    model, optimizer = train(data, pair, "gradients")
    expected, _ = reference(data)
    assert optimizer.ranks == 2
    for p, q in zip(model.parameters(), expected.parameters()):
        assert torch.allclose(p, q, atol=TOL)
    hvd.barrier()
