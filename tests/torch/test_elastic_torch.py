"""dualframe.torch.reliability.elastic in one process: argument checks, and TorchState's commit/restore of model and optimizer."""
import pytest
import torch
import torch.nn as nn

import dualframe.torch as hvd
from dualframe.errors import StrategyError


def test_bad_arguments_are_refused():
    with pytest.raises(StrategyError, match=r"model must be a torch.nn.Module or None \(model: str\)"):
        hvd.elastic.TorchState("model")
    with pytest.raises(StrategyError, match=r"optimizer must be a torch.optim.Optimizer or None \(optimizer: int\)"):
        hvd.elastic.TorchState(nn.Linear(2, 1), 3)
    with pytest.raises(StrategyError, match="run decorates a training function"):
        hvd.elastic.run(42)


def test_restore_goes_back_to_the_last_commit():
    hvd.init()
    model = nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    state = hvd.elastic.TorchState(model, optimizer, step=0)
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    model(torch.ones(3, 2)).sum().backward()
    optimizer.step()
    state.step = 5
    state.restore()
    assert state.step == 0 and not optimizer.state_dict()["state"]
    for key, value in model.state_dict().items():
        assert torch.equal(value, saved[key]), key


def test_under_elastic_horovod_the_optimizer_decides_per_step_and_needs_no_collective_to_start(monkeypatch):
    """HOROVOD_ELASTIC=1 on one worker: hooks registered, groups formed locally, nothing reduced, plain SGD's numbers."""
    hvd.init()
    monkeypatch.setenv("HOROVOD_ELASTIC", "1")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))
    plain = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))
    plain.load_state_dict(model.state_dict())
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                         named_parameters=model.named_parameters(), groups=2)
    reference = torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9)
    assert optimizer._elastic and optimizer._hook_handles and len(optimizer._group_counts) == 2
    for step in range(3):
        x = torch.randn(5, 3, generator=torch.Generator().manual_seed(step))
        for net, opt in ((model, optimizer), (plain, reference)):
            opt.zero_grad()
            net(x).pow(2).mean().backward()
            opt.step()
        assert not optimizer._active and not optimizer._handles
    for got, want in zip(model.parameters(), plain.parameters()):
        assert torch.allclose(got, want, atol=1e-7)


def test_torch_state_syncs_a_distributed_optimizer_without_stepping_it():
    """A joining worker's fresh DistributedOptimizer gets its state by a step of the wrapped optimizer (no allreduce)."""
    hvd.init()
    model = nn.Linear(2, 1)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                         named_parameters=model.named_parameters())
    state = hvd.elastic.TorchState(model, optimizer, step=0)
    assert type(state._handlers["optimizer"]).__name__ == "_OptimizerHandler"
    state.sync()
    assert len(optimizer.state_dict()["state"]) == 2 and not optimizer._handles
