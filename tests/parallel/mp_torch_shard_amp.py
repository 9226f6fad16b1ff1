"""Mixed precision with the torch sharded optimizer on 2 ranks: autocast, fp32 master slices, ShardedGradScaler.

Every rank runs every test. Autocast runs compare with plain data parallelism under the same autocast
(and torch's GradScaler in Horovod's recipe); float16/bfloat16 weights compare with a one-process
reference that keeps fp32 master weights, fed the two ranks' halves of the batch, reduced as the ranks
reduce them. An inf put into one rank's reduced slice must skip the step on both ranks and halve the
scale on both. The Keras twin: mp_tf_shard_amp.py.
"""
import pytest
import torch
import torch.nn as nn

import dualframe
import dualframe.torch as hvd
from mp_torch_shard import several_buckets, started  # noqa: F401 (fixtures: Horovod on 2 ranks, small buckets)

TOL = 1e-5
STEPS = 3


def make(dtype=torch.float32):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))
    return model.to(dtype)


def batches(seed=1, rows=8):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(rows, 6, generator=g), torch.randn(rows, 3, generator=g)) for _ in range(STEPS)]


def loss(model, x, y, autocast=None):
    dtype = next(model.parameters()).dtype
    with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
        out = model(x.to(dtype))
    return ((out.float() - y) ** 2).mean()


def adam(params):
    return torch.optim.Adam(params, lr=0.05)


def sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def assert_close(a, b, tol):
    for p, q in zip(a, b):
        assert p.dtype == q.dtype and torch.allclose(p.float(), q.float(), atol=tol), (p.float() - q.float()).abs().max()


def train_autocast(shard, autocast, scaled):
    """Under autocast, fp32 weights: sharded (ShardedGradScaler) or plain (Horovod's GradScaler recipe).

    SGD when scaled (Adam would hide a gradient left scaled), Adam otherwise.
    """
    model = make()
    make_optimizer = sgd if scaled else adam
    optimizer = hvd.DistributedOptimizer(make_optimizer(model.parameters()), model.named_parameters(), shard=shard)
    scaler = (hvd.ShardedGradScaler if shard else torch.amp.GradScaler)("cpu", enabled=scaled, init_scale=1024.0)
    for x, y in batches():
        optimizer.zero_grad()
        scaler.scale(loss(model, hvd.shard_batch(x), hvd.shard_batch(y), autocast)).backward()
        if shard:
            scaler.step(optimizer)
        else:
            optimizer.synchronize()
            scaler.unscale_(optimizer)
            with optimizer.skip_synchronize():
                scaler.step(optimizer)
        scaler.update()
    return model, scaler.get_scale()


@pytest.mark.parametrize("shard", ["optimizer", "gradients"])
@pytest.mark.parametrize("autocast, scaled", [(torch.bfloat16, False), (torch.float16, True)])
def test_autocast_equals_plain_data_parallel(shard, autocast, scaled):
    model, scale = train_autocast(shard, autocast, scaled)
    plain, plain_scale = train_autocast(None, autocast, scaled)
    assert scale == plain_scale == (1024.0 if scaled else 1.0)
    assert_close(list(model.parameters()), list(plain.parameters()), TOL)


def reference(dtype, make_optimizer, scale):
    """One process: the low-precision model computes each rank's half, fp32 masters step on their average."""
    model = make(dtype)
    masters = [p.detach().float().clone().requires_grad_() for p in model.parameters()]
    optimizer = make_optimizer(masters)
    for x, y in batches():
        halves = []
        for r in range(2):
            model.zero_grad()
            (loss(model, x[4 * r:4 * r + 4], y[4 * r:4 * r + 4]) * scale).backward()
            halves.append([p.grad.clone() for p in model.parameters()])
        for master, a, b in zip(masters, *halves):
            if dtype == torch.bfloat16:  # Horovod cannot sum bfloat16: the ranks sum in fp32
                a, b = a.float(), b.float()
            master.grad = ((a + b) * 0.5).float() / scale
        optimizer.step()
        with torch.no_grad():
            for p, master in zip(model.parameters(), masters):
                p.copy_(master)
    return model, optimizer


@pytest.mark.parametrize("shard", ["optimizer", "gradients"])
@pytest.mark.parametrize("dtype, make_optimizer, tol", [(torch.bfloat16, adam, TOL), (torch.float16, sgd, 1e-3)])
def test_low_precision_weights_step_through_fp32_master_slices(shard, dtype, make_optimizer, tol):
    model = make(dtype)
    optimizer = hvd.DistributedOptimizer(make_optimizer(model.parameters()), model.named_parameters(), shard=shard)
    scaler = hvd.ShardedGradScaler("cpu", init_scale=256.0, enabled=dtype == torch.float16)
    for x, y in batches():
        optimizer.zero_grad()
        scaler.scale(loss(model, hvd.shard_batch(x), hvd.shard_batch(y))).backward()
        scaler.step(optimizer)
        scaler.update()
    expected, plain = reference(dtype, make_optimizer, 256.0 if dtype == torch.float16 else 1.0)
    assert all(p.dtype == dtype for p in model.parameters())
    assert_close(list(model.parameters()), list(expected.parameters()), tol)
    # The masters: fp32, 1/N of the elements on each rank; the optimizer state likewise.
    masters = [p for group in optimizer.inner.param_groups for p in group["params"]]
    assert all(m.dtype == torch.float32 for m in masters)
    total = sum(p.numel() for p in model.parameters())
    mine = sum(m.numel() for m in masters)
    state = sum(v.numel() * v.element_size() for s in optimizer.state.values() for v in s.values()
                if torch.is_tensor(v) and v.numel() > 1)
    plain_state = sum(v.numel() * v.element_size() for s in plain.state.values() for v in s.values()
                      if torch.is_tensor(v) and v.numel() > 1)
    everyone = hvd.allgather(torch.tensor([[mine, state]]), name="amp.bytes")
    assert everyone[:, 0].sum() <= total + 2 * len(optimizer._slots) and mine <= total // 2 + len(optimizer._slots)
    assert everyone[:, 1].sum() == pytest.approx(plain_state, rel=0.05)  # padding: a few elements


@pytest.mark.parametrize("shard", ["optimizer", "gradients"])
def test_inf_in_one_ranks_slice_skips_the_step_on_every_rank(shard):
    model = make(torch.float16)
    optimizer = hvd.DistributedOptimizer(adam(model.parameters()), model.named_parameters(), shard=shard)
    scaler = hvd.ShardedGradScaler("cpu", init_scale=256.0, growth_interval=2)
    (x, y), before = batches()[0], [p.detach().clone() for p in model.parameters()]
    scaler.scale(loss(model, hvd.shard_batch(x), hvd.shard_batch(y))).backward()
    slices = optimizer.reduced_slices()
    if hvd.rank() == 1:
        slices[-1][0] = float("inf")  # in rank 1's slice only: rank 0's reduced gradients are all finite
    scaler.step(optimizer)
    scaler.update()
    assert scaler.get_scale() == 128.0
    assert_close(list(model.parameters()), before, 0.0)
    assert optimizer.state == {} or all(len(s) == 0 for s in optimizer.state.values())  # no Adam step taken
    scales = hvd.allgather(torch.tensor([scaler.get_scale()]), name="amp.scale")
    assert scales.tolist() == [128.0, 128.0]
    for x, y in batches(2)[:2]:  # growth_interval good steps: the scale grows back on both ranks
        optimizer.zero_grad()
        scaler.scale(loss(model, hvd.shard_batch(x), hvd.shard_batch(y))).backward()
        scaler.step(optimizer)
        scaler.update()
    assert scaler.get_scale() == 256.0
    assert not torch.equal(next(model.parameters()), before[0])


def test_torch_grad_scaler_refused_on_every_rank():
    model = make()
    optimizer = hvd.DistributedOptimizer(adam(model.parameters()), model.named_parameters(), shard="optimizer")
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(loss(model, *batches()[0], torch.float16)).backward()
    with pytest.raises(dualframe.StrategyError, match="hvd.ShardedGradScaler"):
        scaler.step(optimizer)
    optimizer.synchronize()  # the reductions started in backward finish before the next test
