"""torch checkpoints in one process: round trip with optimizer and RNG, weights_only loads, stage merge, bad input."""
import os
import pickle
import random

import numpy as np
import pytest
import torch
import torch.nn as nn

from dualframe.reliability.checkpoint import CheckpointError
from dualframe.torch import load_checkpoint, merge_stage_checkpoints, save_checkpoint


def model_and_optimizer(seed):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    return model, optimizer


def one_step(model, optimizer):
    optimizer.zero_grad()
    model(torch.randn(5, 3)).pow(2).mean().backward()
    optimizer.step()


def test_round_trip_restores_weights_optimizer_progress_and_rng(tmp_path):
    model, optimizer = model_and_optimizer(0)
    one_step(model, optimizer)
    torch.manual_seed(7); np.random.seed(7); random.seed(7)
    save_checkpoint(str(tmp_path), model, optimizer, step=3, epoch=1, data_position={"batch": 4}, extra={"lr": 0.01})
    expected_draws = (torch.rand(3), np.random.rand(3), random.random())
    one_step(model, optimizer)
    expected = {k: v.clone() for k, v in model.state_dict().items()}

    other, other_optimizer = model_and_optimizer(1)
    torch.manual_seed(99); np.random.seed(99); random.seed(99)
    state = load_checkpoint(str(tmp_path), other, other_optimizer)
    assert (state.step, state.epoch, state.data_position, state.extra) == (3, 1, {"batch": 4}, {"lr": 0.01})
    draws = (torch.rand(3), np.random.rand(3), random.random())
    assert torch.equal(draws[0], expected_draws[0]) and np.array_equal(draws[1], expected_draws[1])
    assert draws[2] == expected_draws[2]
    torch.manual_seed(7); np.random.seed(7); random.seed(7)  # the stream after the save, as above
    torch.rand(3)
    one_step(other, other_optimizer)
    for key, value in other.state_dict().items():
        assert torch.allclose(value, expected[key], atol=1e-7), key


def test_keep_last_k_and_missing_checkpoint(tmp_path):
    model, optimizer = model_and_optimizer(0)
    assert load_checkpoint(str(tmp_path), model) is None
    for step in range(4):
        save_checkpoint(str(tmp_path), model, optimizer, step=step, keep=2)
    assert sorted(p for p in os.listdir(tmp_path) if p.endswith(".pt")) == [
        "checkpoint-00000002.pt", "checkpoint-00000003.pt"]
    assert load_checkpoint(str(tmp_path), model, optimizer).step == 3


def test_a_pickled_object_is_never_unpickled(tmp_path):
    class Evil:
        def __reduce__(self):
            return (os.system, ("touch " + str(tmp_path / "pwned"),))

    path = tmp_path / "evil.pt"
    path.write_bytes(pickle.dumps({"format": "dualframe-torch-checkpoint/1", "model": Evil()}))
    model, _ = model_and_optimizer(0)
    with pytest.raises(CheckpointError, match="not a loadable dualframe torch checkpoint"):
        load_checkpoint(str(path), model)
    assert not (tmp_path / "pwned").exists()


def test_pipeline_stage_parts_merge_into_the_full_model(tmp_path):
    full, _ = model_and_optimizer(0)
    first, second = nn.Sequential(), nn.Sequential()
    first.add_module("0", full[0]); first.add_module("1", full[1])
    second.add_module("2", full[2])
    save_checkpoint(str(tmp_path / "stage-0"), first, step=5)
    save_checkpoint(str(tmp_path / "stage-1"), second, step=5)
    merged = merge_stage_checkpoints([str(tmp_path / "stage-0"), str(tmp_path / "stage-1")], str(tmp_path / "full.pt"))
    fresh, _ = model_and_optimizer(1)
    assert load_checkpoint(merged, fresh).step == 5
    for key, value in full.state_dict().items():
        assert torch.equal(fresh.state_dict()[key], value)
    save_checkpoint(str(tmp_path / "stage-1"), second, step=6)  # stage 0 never saved step 6: step 5 is merged
    assert load_checkpoint(merge_stage_checkpoints(str(tmp_path), str(tmp_path / "y.pt")), fresh).step == 5
    save_checkpoint(str(tmp_path / "stage-0"), first, step=7, keep=1)
    with pytest.raises(CheckpointError, match=r"no common step \(steps by stage: \[\[7\], \[5, 6\]\]\)"):
        merge_stage_checkpoints([str(tmp_path / "stage-0"), str(tmp_path / "stage-1")], str(tmp_path / "x.pt"))


@pytest.mark.parametrize("kwargs, message", [
    ({"step": -1}, r"step must be an int >= 0 \(step: -1\)"),
    ({"step": 1, "keep": 0}, r"keep must be an int >= 1"),
    ({"step": 1, "data_position": object()}, r"data_position must hold only JSON values"),
    ({"step": 1, "root_rank": 3}, r"root_rank must be a rank in \[0, 1\) \(root_rank: 3\)"),
])
def test_bad_arguments_are_refused_before_writing(tmp_path, kwargs, message):
    model, optimizer = model_and_optimizer(0)
    with pytest.raises(CheckpointError, match=message):
        save_checkpoint(str(tmp_path), model, optimizer, **kwargs)
    with pytest.raises(CheckpointError, match="model must be a torch.nn.Module"):
        save_checkpoint(str(tmp_path), "model", step=1)  # type: ignore[arg-type]
    assert os.listdir(tmp_path) == []
