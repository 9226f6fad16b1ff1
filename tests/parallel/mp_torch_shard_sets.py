"""The sharded optimizer on 4 ranks (oversubscribed): slices of a quarter, two process sets of 2 ranks each, and
ZeRO-3 checkpoints resumed on another number of ranks (4 -> 2, 2 -> 4).

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
    steps(model, optimizer, data, process_set)
    return model, optimizer


def steps(model, optimizer, data, process_set):
    """A step per batch, each rank of ``process_set`` on its 1/N of the rows."""
    n, r = process_set.size(), process_set.rank()
    for x, y in data:
        optimizer.zero_grad()
        rows = slice(r * len(x) // n, (r + 1) * len(x) // n)
        ((model(x[rows]) - y[rows]) ** 2).mean().backward()
        optimizer.step()


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


def zero3(seed, process_set):
    model = make_residual(seed)
    return model, hvd.DistributedOptimizer(adamw(model), model.named_parameters(), shard="parameters", model=model,
                                           process_set=process_set)


@pytest.mark.parametrize("saved_on, resumed_on", [(4, 2), (2, 4)])
def test_zero3_checkpoint_resumes_on_another_number_of_ranks(saved_on, resumed_on):
    """Two ZeRO-3 steps on ``saved_on`` ranks (2: each pair alike), the unsharded weights and state loaded by
    ``resumed_on`` ranks into a model of other weights, a third step: weights and AdamW state equal one process."""
    sets = {4: hvd.global_process_set, 2: PAIRS[hvd.rank() // 2]}
    data = batches(3, steps=3)
    model, optimizer = zero3(0, sets[saved_on])
    steps(model, optimizer, data[:2], sets[saved_on])
    weights, state = optimizer.model_state_dict(), optimizer.state_dict()  # the plain layout
    resumed_model, resumed = zero3(5, sets[resumed_on])
    resumed.load_model_state_dict(weights)
    resumed.load_state_dict(state)
    steps(resumed_model, resumed, data[2:], sets[resumed_on])
    assert resumed.ranks == resumed_on and optimizer.ranks == saved_on
    expected, ref_optimizer = reference(data)
    full = resumed.model_state_dict()
    for key, value in expected.state_dict().items():
        assert torch.allclose(full[key], value, atol=TOL), (key, (full[key] - value).abs().max())
    got = resumed.state_dict()["state"]
    for i, entry in ref_optimizer.state_dict()["state"].items():
        for name in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.allclose(got[i][name], entry[name], atol=TOL), (i, name)
