"""torch pipeline stage checkpoints in one process (a one-stage DistributedPipeline): round trip, merge, bad input."""
import os

import pytest
import torch
from torch import nn

import dualframe.torch as hvd
from dualframe.reliability.checkpoint import CheckpointError


@pytest.fixture(scope="module")
def pipe():
    hvd.init()
    torch.manual_seed(0)
    return hvd.DistributedPipeline(nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1)), [3], chunks=2,
                                   loss_fn=nn.MSELoss())


def test_round_trip_and_merge_into_the_plain_model(pipe, tmp_path):
    optimizer = torch.optim.SGD(pipe.parameters(), lr=0.1, momentum=0.9)
    pipe.train_step(torch.randn(4, 3), torch.randn(4, 1))
    optimizer.step()
    saved = {k: v.clone() for k, v in pipe.state_dict().items()}
    hvd.save_stage_checkpoint(str(tmp_path), pipe, optimizer, step=3, data_position={"next_step": 4})
    assert os.listdir(tmp_path) == ["stage-0"]
    with torch.no_grad():
        for p in pipe.parameters():
            p.zero_()
    state = hvd.load_stage_checkpoint(str(tmp_path), pipe, optimizer)
    assert (state.step, state.data_position) == (3, {"next_step": 4})
    assert all(torch.equal(pipe.state_dict()[k], v) for k, v in saved.items())
    plain = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))
    plain.load_state_dict(torch.load(hvd.merge_stage_checkpoints(str(tmp_path), str(tmp_path / "full.pt")),
                                     weights_only=True)["model"])
    assert all(torch.equal(plain.state_dict()[k], v) for k, v in saved.items())


@pytest.mark.parametrize("bad, kwargs, message", [
    ({"pipe": "m"}, {"step": 1}, r"pipe must be a dualframe.torch.DistributedPipeline \(pipe: str\)"),
    ({"optimizer": 5}, {"step": 1}, r"optimizer must be a torch.optim.Optimizer or None \(optimizer: int\)"),
    ({}, {"step": -1}, r"step must be an int >= 0 \(step: -1\)"),
    ({}, {"step": 1, "keep": 0}, r"keep must be an int >= 1 \(keep: 0\)"),
    ({}, {"step": 1, "extra": {"x": object()}}, r"extra must hold only JSON values"),
])
def test_bad_arguments_are_refused_before_writing(pipe, tmp_path, bad, kwargs, message):
    with pytest.raises(CheckpointError, match=message):
        hvd.save_stage_checkpoint(str(tmp_path / "c"), bad.get("pipe", pipe), bad.get("optimizer"), **kwargs)
    assert not (tmp_path / "c").exists()
