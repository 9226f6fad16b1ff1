"""The torch sharded optimizer in one process (size 1): plain numbers, the plan's state bytes, refusals, elastic state."""
import pytest
import torch
import torch.nn as nn

import dualframe.torch as hvd
from dualframe.errors import StrategyError
from dualframe.plan import Training, group_memory
from dualframe.torch.plan.probe import profile_module


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))


def state_bytes(optimizer):
    return sum(v.numel() * v.element_size() for s in optimizer.state.values() for k, v in s.items()
               if torch.is_tensor(v) and k != "step")


def train(net, optimizer, steps=3):
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        optimizer.zero_grad()
        net(torch.randn(8, 6, generator=g)).pow(2).mean().backward()
        optimizer.step()


@pytest.mark.parametrize("name, make, training", [
    ("adam", lambda p: torch.optim.Adam(p, lr=0.01), "adam"),
    ("momentum", lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), "momentum"),
])
@pytest.mark.parametrize("shard", ["optimizer", "gradients"])
def test_size_one_equals_plain_and_the_plan_counts_its_state(name, make, training, shard):
    hvd.init()
    plain_net, sharded_net = model(), model()
    plain = make(plain_net.parameters())
    sharded = hvd.DistributedOptimizer(make(sharded_net.parameters()), sharded_net.named_parameters(), shard=shard)
    train(plain_net, plain)
    train(sharded_net, sharded)
    for p, q in zip(plain_net.parameters(), sharded_net.parameters()):
        assert torch.allclose(p, q, atol=1e-6)
    profile = profile_module(model(), (6,))
    planned = group_memory(profile, range(profile.num_layers), Training(8, training), replicas=1, shard=shard)
    assert state_bytes(sharded) == planned.optimizer == state_bytes(plain)


def test_refused_before_any_communication_in_one_process():
    hvd.init()
    net = model()
    with pytest.raises(StrategyError, match="element-wise optimizer"):
        hvd.DistributedOptimizer(torch.optim.LBFGS(net.parameters()), shard="optimizer")
    with pytest.raises(StrategyError, match="shard='parameters' gathers each block's parameters .* needs the model"):
        hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), shard="parameters")
    opt = hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), shard="optimizer")
    with pytest.raises(StrategyError, match="step\\(closure\\) is not available"):
        opt.step(lambda: 0.0)
    with pytest.raises(StrategyError, match="add_param_group is not available"):
        opt.add_param_group({"params": [nn.Parameter(torch.ones(1))]})
    net.to(torch.float64)  # re-assigns every parameter: the slices would no longer be the model's
    net(torch.ones(1, 6, dtype=torch.float64)).sum().backward()
    with pytest.raises(StrategyError, match="moved or re-assigned after wrapping"):
        opt.step()


def test_param_groups_each_their_own_slices_and_lr():
    hvd.init()
    plain_net, sharded_net = model(), model()

    def groups(net):
        return [{"params": net[0].parameters(), "lr": 0.05}, {"params": net[2].parameters()},
                {"params": net[4].parameters(), "lr": 0.2, "weight_decay": 0.01}]
    plain = torch.optim.AdamW(groups(plain_net), lr=0.01)
    sharded = hvd.DistributedOptimizer(torch.optim.AdamW(groups(sharded_net), lr=0.01), shard="gradients")
    train(plain_net, plain)
    train(sharded_net, sharded)
    assert [g["lr"] for g in sharded.inner.param_groups] == [0.05, 0.01, 0.2]
    for p, q in zip(plain_net.parameters(), sharded_net.parameters()):
        assert torch.allclose(p, q, atol=1e-6)
    full = sharded.state_dict()
    assert full["param_groups"][2]["weight_decay"] == 0.01
    for i, entry in plain.state_dict()["state"].items():
        assert torch.allclose(full["state"][i]["exp_avg_sq"], entry["exp_avg_sq"], atol=1e-7)


def test_torch_state_commits_a_sharded_optimizer_without_a_collective_at_construction():
    hvd.init()
    net = model()
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9), shard="optimizer")
    state = hvd.elastic.TorchState(net, optimizer, step=0)
    assert type(state._handlers["optimizer"]).__name__ == "_ShardedOptimizerHandler"
    assert state.optimizer is optimizer and state._handlers["optimizer"]._saved is None
    train(net, optimizer, 1)
    state.commit()
    saved = {k: v.clone() for k, v in net.state_dict().items()}
    momentum = state_bytes(optimizer)
    train(net, optimizer, 2)
    state.restore()
    assert state_bytes(optimizer) == momentum
    for key, value in net.state_dict().items():
        assert torch.equal(value, saved[key])
    state.sync()


def test_zero_grad_is_refused_while_gradients_accumulate_or_are_sent():
    hvd.init()
    net = model()
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), shard="gradients",
                                         backward_passes_per_step=2)
    net(torch.ones(2, 6)).sum().backward()
    with pytest.raises(AssertionError, match="zero_grad"):
        optimizer.zero_grad()
    net(torch.ones(2, 6)).sum().backward()
    with pytest.raises(AssertionError, match="zero_grad"):
        optimizer.zero_grad()
    optimizer.step()
    optimizer.zero_grad()
    assert all(p.grad is None for p in net.parameters())


@pytest.mark.parametrize("shard", ["optimizer", "gradients"])
def test_distribute_passes_the_strategy_shard_and_equals_unsharded(shard):
    import dualframe
    from dualframe.torch.dp.shard.optimizer import ShardedOptimizer
    # SGD with momentum: for a plain optimizer without state, Horovod's broadcast_optimizer_state takes
    # a zero-gradient step, which advances Adam's step count (a sharded optimizer's broadcast does not).
    plain_net, sharded_net = model(), model()
    _, plain = hvd.distribute(plain_net, torch.optim.SGD(plain_net.parameters(), lr=0.1, momentum=0.9))
    _, sharded = hvd.distribute(sharded_net, torch.optim.SGD(sharded_net.parameters(), lr=0.1, momentum=0.9),
                                strategy=dualframe.DataParallel(shard=shard))
    assert isinstance(sharded, ShardedOptimizer) and sharded.shard == shard and sharded.scatter == "auto"
    assert not isinstance(plain, ShardedOptimizer) and plain.shard is None
    train(plain_net, plain)
    train(sharded_net, sharded)
    for p, q in zip(plain_net.parameters(), sharded_net.parameters()):
        assert torch.allclose(p, q, atol=1e-6)


@pytest.mark.parametrize("scatter", ["auto", "allreduce", "reducescatter"])
def test_each_scatter_path_equals_plain(scatter):
    hvd.init()
    plain_net, sharded_net = model(), model()
    plain = torch.optim.SGD(plain_net.parameters(), lr=0.1, momentum=0.9)
    sharded = hvd.DistributedOptimizer(torch.optim.SGD(sharded_net.parameters(), lr=0.1, momentum=0.9),
                                       sharded_net.named_parameters(), shard="gradients", scatter=scatter)
    assert sharded.gradient_path == ("allreduce" if scatter == "auto" else scatter)
    train(plain_net, plain)
    train(sharded_net, sharded)
    for p, q in zip(plain_net.parameters(), sharded_net.parameters()):
        assert torch.allclose(p, q, atol=1e-6)


@pytest.mark.parametrize("kwargs, message", [
    ({"scatter": "allreduce"}, r"scatter='allreduce' .* needs shard='optimizer' or 'gradients' \(shard: None\)"),
    ({"scatter": "reducescatter", "shard": "none"}, r"needs shard="),
    ({"scatter": "ring", "shard": "optimizer"}, r"unknown scatter 'ring'; choose one of auto, reducescatter, allreduce"),
])
def test_scatter_refused_without_shard_or_unknown(kwargs, message):
    hvd.init()
    with pytest.raises(StrategyError, match=message):
        hvd.DistributedOptimizer(torch.optim.SGD(model().parameters(), lr=0.1), **kwargs)


@pytest.mark.parametrize("shard", ["optimizer", "gradients", None])  # None: the plain wrapper's clip_grad_norm_
@pytest.mark.parametrize("norm_type", [2.0, 1.0, float("inf")])
def test_clip_grad_norm_equals_torch_on_the_whole_gradients(shard, norm_type):
    hvd.init()
    plain_net, sharded_net = model(), model()
    plain = torch.optim.Adam(plain_net.parameters(), lr=0.01)
    sharded = hvd.DistributedOptimizer(torch.optim.Adam(sharded_net.parameters(), lr=0.01),
                                       sharded_net.named_parameters(), shard=shard)
    g = torch.Generator().manual_seed(3)
    for _ in range(3):
        x = torch.randn(8, 6, generator=g)
        for net, optimizer in ((plain_net, plain), (sharded_net, sharded)):
            optimizer.zero_grad()
            (net(x) * 10).pow(2).mean().backward()
        expected = torch.nn.utils.clip_grad_norm_(plain_net.parameters(), 0.5, norm_type)
        total = sharded.clip_grad_norm_(0.5, norm_type)
        assert total > 0.5 and torch.allclose(total, expected, rtol=1e-5)
        plain.step()
        sharded.step()
    for p, q in zip(plain_net.parameters(), sharded_net.parameters()):
        assert torch.allclose(p, q, atol=1e-6)


def test_plain_clip_grad_norm_refuses_bad_numbers():
    hvd.init()
    net = model()
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), net.named_parameters())
    with pytest.raises(StrategyError, match=r"norm_type must be a number > 0 \(norm_type: -1\)"):
        optimizer.clip_grad_norm_(1.0, -1)


def test_horovod_clip_recipe_refused_with_a_sharded_optimizer():
    hvd.init()
    net = model()
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), net.named_parameters(),
                                         shard="optimizer")
    with pytest.raises(StrategyError, match=r"max_norm must be a number > 0 \(max_norm: 0\)"):
        optimizer.clip_grad_norm_(0)
    net(torch.ones(2, 6)).sum().backward()
    optimizer.synchronize()
    with optimizer.skip_synchronize():
        optimizer.step()  # untouched .grad: Horovod's pattern without a change is fine
    optimizer.zero_grad()
    net(torch.ones(2, 6)).sum().backward()
    optimizer.synchronize()
    torch.nn.utils.clip_grad_norm_(net.parameters(), 1e-3)
    with pytest.raises(StrategyError, match=r"\.grad changed between synchronize\(\) and step\(\).*"
                                            r"optimizer\.clip_grad_norm_\(max_norm\)"):
        with optimizer.skip_synchronize():
            optimizer.step()
