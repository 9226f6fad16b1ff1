"""Virtual stages with replicas on 4 processes: 2 replicas x 2 ranks x 2 stages per rank, against one process.

Each rank holds two stages of its replica's pipeline; the ranks at the same position of the two replicas
hold the same stages and average their gradients (the position's process set), so the weights equal one
process training the whole model on the global batch.
"""
# np: 4
# timeout: 400
import copy

import pytest
import torch
from torch import nn

import dualframe.torch as hvd
from dualframe.errors import StrategyError
from dualframe.torch.pipeline.distributed import DistributedPipeline
from mp_torch_dpipe_hybrid import merged_state, reference_step, replica_step, started  # noqa: F401 (the launch's)

STEPS, GLOBAL_BATCH = 3, 16
HELD = {"interleaved-1f1b": [[0, 2], [1, 3]], "zb-v": [[0, 3], [1, 2]]}  # by position in the pipeline


def make_model():
    torch.manual_seed(4)
    return nn.Sequential(nn.Linear(5, 12), nn.Tanh(), nn.Linear(12, 12), nn.Tanh(), nn.Linear(12, 12), nn.Tanh(),
                         nn.Linear(12, 2))


@pytest.mark.parametrize("schedule, shard, checkpoint", [("interleaved-1f1b", None, "never"),
                                                        ("zb-v", None, "always"), ("zb-v", "gradients", "never")])
def test_virtual_stages_with_replicas_equal_one_process_on_the_global_batch(schedule, shard, checkpoint):
    model = make_model()
    generator = torch.Generator().manual_seed(6)
    data = [(torch.randn(GLOBAL_BATCH, 5, generator=generator), torch.randn(GLOBAL_BATCH, 2, generator=generator))
            for _ in range(STEPS)]
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
