"""The sharded optimizer on 2 ranks: distribute(DataParallel(shard=)), both scatter paths, and clip_grad_norm_.

Every rank runs every test. Each compares with plain data parallelism or with a one-process
reference computed inside the rank (the same initial model trained on the whole global batch).
"""
import warnings

import pytest
import torch
import torch.nn as nn

import dualframe
import dualframe.torch as hvd
import dualframe.torch.dp.shard.optimizer as shard_module

TOL = 1e-5


@pytest.fixture(scope="module", autouse=True)
def started():
    hvd.init()
    assert hvd.size() == 2


@pytest.fixture(autouse=True)
def several_buckets(monkeypatch):
    monkeypatch.setattr(shard_module, "BUCKET_ELEMENTS", 30)  # several buckets, uneven halves


def make(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 3))


def batches(seed=1, steps=4, rows=8):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(rows, 6, generator=g), 5 * torch.randn(rows, 3, generator=g)) for _ in range(steps)]


def loss(model, x, y):
    return ((model(x) - y) ** 2).mean()


def assert_close(a, b, tol=TOL):
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.allclose(p, q, atol=tol), (p - q).abs().max()


def reference(data, make_optimizer, max_norm=None):
    """One process, the whole global batch; returns the model and the norms clip_grad_norm_ saw."""
    model = make(0)
    optimizer, norms = make_optimizer(model), []
    for x, y in data:
        optimizer.zero_grad()
        loss(model, x, y).backward()
        if max_norm is not None:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm))
        optimizer.step()
    return model, norms


def sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def adam(model):
    return torch.optim.Adam(model.parameters(), lr=0.05)


@pytest.mark.parametrize("shard", ["optimizer", "gradients"])
def test_distribute_with_shard_equals_distribute_without(shard):
    data = batches()
    results = {}
    for mode in ("none", shard):
        model = make(hvd.rank())  # distribute broadcasts rank 0's weights
        model, optimizer = hvd.distribute(model, sgd(model), dualframe.DataParallel(shard=mode))
        assert optimizer.shard == (None if mode == "none" else mode)
        for x, y in data:
            optimizer.zero_grad()
            loss(model, hvd.shard_batch(x), hvd.shard_batch(y)).backward()
            optimizer.step()
        results[mode] = model
    assert_close(results[shard], results["none"])
    assert_close(results[shard], reference(data, sgd)[0])


@pytest.mark.parametrize("scatter", ["reducescatter", "allreduce"])
@pytest.mark.parametrize("shard", ["optimizer", "gradients"])
def test_each_scatter_path_equals_one_process(shard, scatter):
    data = batches(2)
    model = make(0)
    optimizer = hvd.DistributedOptimizer(adam(model), model.named_parameters(), shard=shard, scatter=scatter)
    assert optimizer.gradient_path == scatter and len(optimizer._slots) > 2
    for x, y in data:
        optimizer.zero_grad()
        loss(model, hvd.shard_batch(x), hvd.shard_batch(y)).backward()
        optimizer.step()
    assert_close(model, reference(data, adam)[0])


def plain_clipped(data, max_norm):
    """Plain data parallelism with Horovod's clipping recipe (synchronize, clip, skip_synchronize step)."""
    model = make(0)
    optimizer, norms = hvd.DistributedOptimizer(adam(model), model.named_parameters()), []
    for x, y in data:
        optimizer.zero_grad()
        loss(model, hvd.shard_batch(x), hvd.shard_batch(y)).backward()
        optimizer.synchronize()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm))
        with optimizer.skip_synchronize():
            optimizer.step()
    return model, norms


@pytest.mark.parametrize("scatter", ["reducescatter", "allreduce"])
@pytest.mark.parametrize("shard", ["optimizer", "gradients"])
def test_clip_grad_norm_equals_plain_data_parallel_clipping(shard, scatter):
    data, max_norm = batches(3), 1.0
    model = make(0)
    optimizer = hvd.DistributedOptimizer(adam(model), model.named_parameters(), shard=shard, scatter=scatter)
    norms = []
    for x, y in data:
        optimizer.zero_grad()
        loss(model, hvd.shard_batch(x), hvd.shard_batch(y)).backward()
        norms.append(optimizer.clip_grad_norm_(max_norm))
        optimizer.step()
    plain, plain_norms = plain_clipped(data, max_norm)
    expected, reference_norms = reference(data, adam, max_norm)
    assert all(n > max_norm for n in norms)  # the clipping acted at every step
    for mine, theirs, one in zip(norms, plain_norms, reference_norms):
        assert torch.allclose(mine, theirs, rtol=TOL) and torch.allclose(mine, one, rtol=TOL)
    assert_close(model, plain)
    assert_close(model, expected)


def test_plain_clip_grad_norm_equals_horovods_recipe_and_one_process():
    data, max_norm = batches(3), 1.0
    model = make(0)
    optimizer, norms = hvd.DistributedOptimizer(adam(model), model.named_parameters()), []
    for x, y in data:
        optimizer.zero_grad()
        loss(model, hvd.shard_batch(x), hvd.shard_batch(y)).backward()
        norms.append(optimizer.clip_grad_norm_(max_norm))
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a second reduction in step() would warn "reduced again"
            optimizer.step()
    plain, plain_norms = plain_clipped(data, max_norm)
    expected, reference_norms = reference(data, adam, max_norm)
    assert all(n > max_norm for n in norms)
    for mine, theirs, one in zip(norms, plain_norms, reference_norms):
        assert torch.allclose(mine, theirs, rtol=TOL) and torch.allclose(mine, one, rtol=TOL)
    assert_close(model, plain)
    assert_close(model, expected)
    if hvd.mpi_enabled():  # Adasum needs Horovod's MPI controller
        adasum = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
                                          op=hvd.Adasum)
        with pytest.raises(dualframe.StrategyError, match="not available with op=Adasum"):
            adasum.clip_grad_norm_(max_norm)


def test_clip_grad_norm_with_backward_passes_per_step_and_the_recipe_refused():
    data = batches(4)
    model = make(0)
    optimizer = hvd.DistributedOptimizer(adam(model), model.named_parameters(), shard="optimizer",
                                         backward_passes_per_step=2)
    for x, y in data[:2]:
        optimizer.zero_grad()
        for half in (slice(0, 4), slice(4, 8)):  # each rank: two passes of a quarter of the batch
            (loss(model, hvd.shard_batch(x[half]), hvd.shard_batch(y[half])) / 2).backward()
        optimizer.clip_grad_norm_(1.0)
        optimizer.step()
    assert_close(model, reference(data[:2], adam, 1.0)[0])
    x, y = data[2]
    optimizer.zero_grad()
    for _ in range(2):
        loss(model, hvd.shard_batch(x), hvd.shard_batch(y)).backward()
    optimizer.synchronize()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    with pytest.raises(dualframe.StrategyError, match=r"optimizer\.clip_grad_norm_\(max_norm\)"):
        with optimizer.skip_synchronize():
            optimizer.step()
    hvd.barrier()
