"""dualframe.torch.elastic in one process: argument checks, and TorchState's commit/restore of model and optimizer."""
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
