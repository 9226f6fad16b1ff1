"""Virtual stages with replicas on 4 processes: 2 replicas x 2 ranks x 2 stages per rank, against one process.

Each rank holds two stages of its replica's pipeline; the ranks at the same position of the two replicas
hold the same stages and average their gradients (the position's process set), so the weights equal one
process training the whole model on the global batch. A stage checkpoint holds one part per position
(its two stages), written by replica 0 and loaded into every replica.
"""
# np: 4
# timeout: 400
import copy
import os

import horovod.torch as horovod
import pytest
import torch
from torch import nn

import dualframe.torch as hvd
from dualframe.errors import StrategyError
from dualframe.torch.pipeline.distributed import DistributedPipeline
from mp_torch_dpipe_hybrid import batches, merged_state, reference_step, replica_step, started  # noqa: F401

STEPS = 3
HELD = {"interleaved-1f1b": [[0, 2], [1, 3]], "zb-v": [[0, 3], [1, 2]]}  # by position in the pipeline


def make_model():
    torch.manual_seed(4)
    return nn.Sequential(nn.Linear(5, 12), nn.Tanh(), nn.Linear(12, 12), nn.Tanh(), nn.Linear(12, 12), nn.Tanh(),
                         nn.Linear(12, 2))


@pytest.mark.parametrize("schedule, shard, checkpoint", [("interleaved-1f1b", None, "never"),
                                                        ("zb-v", None, "always"), ("zb-v", "gradients", "never")])
def test_virtual_stages_with_replicas_equal_one_process_on_the_global_batch(schedule, shard, checkpoint):
    model, data = make_model(), batches(6, STEPS)
    reference = copy.deepcopy(model)
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.2, momentum=0.9)
    pipe = DistributedPipeline(copy.deepcopy(model), balance=[2, 2, 2, 1], chunks=4, schedule=schedule,
                               loss_fn=nn.MSELoss(), data_parallel=2, virtual_stages=2, checkpoint=checkpoint)
    assert (pipe.replica, pipe.stage_index) == divmod(hvd.rank(), 2)
    assert sorted(pipe.held_stages) == HELD[schedule][pipe.stage_index]
    with pytest.raises(StrategyError, match=r"shard='parameters' among a pipeline stage's replicas runs one stage "
                                            rf"per rank .*\(schedule: '{schedule}', virtual_stages: 2\)"):
        pipe.distributed_optimizer(torch.optim.SGD(pipe.parameters(), lr=0.2), shard="parameters")
    optimizer = pipe.distributed_optimizer(torch.optim.SGD(pipe.parameters(), lr=0.2, momentum=0.9), shard=shard)
    for step, (x, y) in enumerate(data):
        expected = reference_step(reference, ref_optimizer, x, y)
        assert replica_step(pipe, optimizer, x, y) == pytest.approx(expected, abs=1e-5), f"step {step}"
    merged = merged_state(pipe)
    assert sorted(merged) == sorted(reference.state_dict())
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(merged[key], value, atol=1e-5, rtol=0, msg=key)
    for key, value in pipe.state_dict().items():  # both replicas of a position hold the same weights
        torch.testing.assert_close(value, reference.state_dict()[key], atol=1e-5, rtol=0, msg=key)


def virtual_hybrid(seed):
    """A zb-v pipeline of 2 x 2 stages in 2 replicas + its averaged SGD; weights perturbed by ``seed`` (0: none)."""
    pipe = DistributedPipeline(make_model(), balance=[2, 2, 2, 1], chunks=4, schedule="zb-v", loss_fn=nn.MSELoss(),
                               data_parallel=2, virtual_stages=2)
    if seed:  # every rank its own wrong weights: only a load that reaches every replica puts them right
        generator = torch.Generator().manual_seed(seed + hvd.rank())
        with torch.no_grad():
            for parameter in pipe.parameters():
                parameter.add_(torch.randn(parameter.shape, generator=generator))
    return pipe, pipe.distributed_optimizer(torch.optim.SGD(pipe.parameters(), lr=0.2, momentum=0.9))


def test_stage_checkpoint_of_virtual_stages_with_replicas_resumes_and_merges(tmp_path):
    # One part per position (its two stages), written by replica 0, loaded into every replica.
    folder = horovod.broadcast_object(str(tmp_path), 0, name="vstages.hybrid.ckpt.folder")
    ckpt, data = os.path.join(folder, "ckpt"), batches(8, STEPS)
    reference = make_model()
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.2, momentum=0.9)
    expected = [reference_step(reference, ref_optimizer, x, y) for x, y in data]
    pipe, optimizer = virtual_hybrid(0)
    for x, y in data[:2]:
        replica_step(pipe, optimizer, x, y)
    written = hvd.save_stage_checkpoint(ckpt, pipe, optimizer, step=1, data_position={"next_step": 2})
    assert (written is not None) == (pipe.replica == 0) and sorted(os.listdir(ckpt)) == ["stage-0", "stage-1"]
    saved = copy.deepcopy(pipe.state_dict())
    pipe, optimizer = virtual_hybrid(77)  # fresh, perturbed, no momentum yet
    state = hvd.load_stage_checkpoint(ckpt, pipe, optimizer)
    assert state.step == 1 and state.data_position == {"next_step": 2}
    for key, value in saved.items():
        torch.testing.assert_close(pipe.state_dict()[key], value, atol=0, rtol=0, msg=f"rank {hvd.rank()}: {key}")
    assert replica_step(pipe, optimizer, *data[2]) == pytest.approx(expected[2], abs=1e-5)  # momentum restored
    hvd.save_stage_checkpoint(ckpt, pipe, step=2)
    mine = os.path.join(folder, f"full-{hvd.rank()}.pt")  # every rank merges (one process, no communication)
    hvd.merge_stage_checkpoints(ckpt, mine)
    full = torch.load(mine, weights_only=True)["model"]
    assert sorted(full) == sorted(reference.state_dict())
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(full[key], value, atol=1e-5, rtol=0, msg=f"merged {key}")
