"""DistributedPipeline with virtual stages on 2 processes (2 x 2 stages), interleaved 1F1B and ZB-V, against one process."""
import copy
import os

import horovod.torch as horovod
import pytest
import torch
from torch import nn

import dualframe.torch as hvd
from dualframe.errors import BalanceError, ChunksError, ScheduleError, StrategyError
from dualframe.torch.pipeline.distributed import DistributedPipeline
from mp_torch_dpipe import started  # noqa: F401 (fixture: Horovod on 2 ranks; the files share a launch)
from torch_cases import check_pipeline_training, pipeline_batches, pipeline_reference  # tests/parallel is on sys.path

STEPS, BATCH = 3, 12  # chunks=8: micro-batches of 2, 2, 2, 2, 1, 1, 1, 1 rows
BALANCE = [2, 2, 2, 1]  # four stages of the seven layers: two per rank
HELD = {"interleaved-1f1b": [[0, 2], [1, 3]], "zb-v": [[0, 3], [1, 2]]}


def deep_model():
    torch.manual_seed(5)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16), nn.Tanh(),
                         nn.Linear(16, 3))


def test_bad_combinations_are_refused_on_every_rank_before_communication():
    loss = nn.MSELoss()
    with pytest.raises(ScheduleError, match=r"schedule '1f1b' runs one stage per rank, so it cannot run virtual_stages=2"):
        DistributedPipeline(deep_model(), BALANCE, chunks=4, schedule="1f1b", loss_fn=loss, virtual_stages=2)
    with pytest.raises(ChunksError, match=r"interleaved-1f1b needs chunks divisible by the pipeline's ranks.*"
                                          r"\(chunks: 3, ranks: 2\)"):
        DistributedPipeline(deep_model(), BALANCE, chunks=3, schedule="interleaved-1f1b", loss_fn=loss, virtual_stages=2)
    with pytest.raises(ScheduleError, match=r"zb-v places two stages on each rank.*\(virtual_stages: 3\)"):
        DistributedPipeline(deep_model(), [1] * 6 + [1], chunks=4, schedule="zb-v", loss_fn=loss, virtual_stages=3)
    with pytest.raises(BalanceError, match=r"balance must describe ranks x virtual_stages stages.*\(balance: 3 stages, "
                                           r"virtual_stages: 2\)"):
        DistributedPipeline(deep_model(), [3, 2, 2], chunks=4, schedule="zb-v", loss_fn=loss, virtual_stages=2)
    with pytest.raises(StrategyError, match=r"multiple of the number of stages \(processes: 2, stages: 3\)"):
        DistributedPipeline(deep_model(), [1, 1, 1, 1, 1, 2], chunks=6, schedule="zb-v", loss_fn=loss, virtual_stages=2)


@pytest.mark.parametrize("chunks", [4, 8])
@pytest.mark.parametrize("schedule", ["interleaved-1f1b", "zb-v"])
def test_training_equals_one_process(schedule, chunks):
    model, data = deep_model(), pipeline_batches(BATCH, STEPS)
    pipe = DistributedPipeline(copy.deepcopy(model), balance=BALANCE, chunks=chunks, schedule=schedule,
                               loss_fn=nn.MSELoss(), virtual_stages=2)
    assert sorted(pipe.held_stages) == HELD[schedule][hvd.rank()]
    assert (pipe.is_first, pipe.is_last) == ((True, schedule == "zb-v") if hvd.rank() == 0 else
                                             (False, schedule != "zb-v"))
    check_pipeline_training(pipe, data, pipeline_reference(model, data))
    assert [a for a, _, _ in pipe.records.records[-1].actions] == [str(a) for a in pipe.actions]
    assert pipe.meter.live_bytes == 0


@pytest.mark.parametrize("schedule, checkpoint", [("interleaved-1f1b", "always"), ("zb-v", "always"),
                                                  ("zb-v", "except_last")])
def test_activation_checkpointing_equals_one_process(schedule, checkpoint):
    # Each held stage recomputes its own micro-batches in their backward (zb-v: the graph lives from B to W).
    model, data = deep_model(), pipeline_batches(BATCH, STEPS)
    pipe = DistributedPipeline(copy.deepcopy(model), balance=BALANCE, chunks=4, schedule=schedule,
                               loss_fn=nn.MSELoss(), virtual_stages=2, checkpoint=checkpoint)
    assert sorted(pipe.recomputes) == HELD[schedule][hvd.rank()]
    check_pipeline_training(pipe, data, pipeline_reference(model, data))
    assert pipe.meter.live_bytes == 0


def dropout_model():
    torch.manual_seed(6)
    return nn.Sequential(nn.Linear(6, 16), nn.Dropout(0.5), nn.Linear(16, 16), nn.Dropout(0.3), nn.Linear(16, 16),
                         nn.Dropout(0.4), nn.Linear(16, 3))


@pytest.mark.parametrize("schedule", ["interleaved-1f1b", "zb-v"])
def test_checkpointing_replays_each_stages_dropout_masks(schedule):
    # A replayed forward draws its stage's masks from the state its first forward found, whatever the rank's
    # other stage drew between: the gradients equal checkpoint="never"'s from the same seed.
    x, y = pipeline_batches(BATCH, 1)[0]
    grads = {}
    for checkpoint in ("never", "always"):
        pipe = DistributedPipeline(dropout_model(), balance=BALANCE, chunks=4, schedule=schedule,
                                   loss_fn=nn.MSELoss(), virtual_stages=2, checkpoint=checkpoint)
        torch.manual_seed(100 + hvd.rank())
        pipe.train_step(x if pipe.is_first else None, y if pipe.is_last else None)
        grads[checkpoint] = {name: p.grad.clone() for name, p in pipe.named_parameters()}
    assert sorted(grads["always"]) == sorted(grads["never"]) and grads["never"]
    for name, grad in grads["never"].items():
        assert grad.abs().sum() > 0, name
        torch.testing.assert_close(grads["always"][name], grad, atol=1e-6, rtol=0, msg=name)


@pytest.mark.parametrize("schedule", ["interleaved-1f1b", "zb-v"])
def test_inference_and_horovod_broadcasts_equal_the_model(schedule):
    model = deep_model()
    x = torch.randn(8, 6, generator=torch.Generator().manual_seed(3))
    pipe = DistributedPipeline(copy.deepcopy(model), balance=BALANCE, chunks=4, schedule=schedule,
                               loss_fn=nn.MSELoss(), virtual_stages=2, transport="horovod")
    assert pipe.transport == "horovod"
    with torch.no_grad():
        out = pipe(x if pipe.is_first else None)
        if pipe.is_last:
            torch.testing.assert_close(out, model(x), atol=1e-6, rtol=0)
        else:
            assert out is None
    y = torch.randn(8, 3, generator=torch.Generator().manual_seed(4))
    expected = nn.functional.mse_loss(model(x), y).item()
    assert pipe.train_step(x, y) == pytest.approx(expected, abs=1e-5)


def test_stage_checkpoint_resumes_and_merges_into_the_model(tmp_path):
    folder = horovod.broadcast_object(str(tmp_path), 0, name="vstages.ckpt.folder")  # one folder for all ranks
    ckpt = os.path.join(folder, "ckpt")
    model, data = deep_model(), pipeline_batches(BATCH, STEPS)
    expected_losses, expected_state = pipeline_reference(model, data)

    def build(seed):
        torch.manual_seed(seed)
        pipe = DistributedPipeline(copy.deepcopy(model) if seed == 0 else deep_model().apply(_perturb), BALANCE,
                                   chunks=4, schedule="zb-v", loss_fn=nn.MSELoss(), virtual_stages=2)
        return pipe, torch.optim.SGD(pipe.parameters(), lr=0.1, momentum=0.9)

    def step(pipe, optimizer, x, y):
        optimizer.zero_grad()
        loss = pipe.train_step(x, y)
        optimizer.step()
        return loss

    pipe, optimizer = build(0)
    for x, y in data[:2]:
        step(pipe, optimizer, x, y)
    hvd.save_stage_checkpoint(ckpt, pipe, optimizer, step=1, data_position={"next_step": 2})
    assert sorted(os.listdir(ckpt)) == ["stage-0", "stage-1"]  # one part per rank, holding its two stages
    pipe, optimizer = build(1)  # other weights, no momentum yet
    state = hvd.load_stage_checkpoint(ckpt, pipe, optimizer)
    assert state.step == 1 and state.data_position == {"next_step": 2}
    assert step(pipe, optimizer, *data[2]) == pytest.approx(expected_losses[2], abs=1e-5)
    hvd.save_stage_checkpoint(ckpt, pipe, optimizer, step=2)
    mine = os.path.join(folder, f"full-{hvd.rank()}.pt")  # every rank merges (one process, no communication)
    hvd.merge_stage_checkpoints(ckpt, mine)
    full = torch.load(mine, weights_only=True)["model"]
    assert sorted(full) == sorted(expected_state)
    for key, value in expected_state.items():
        torch.testing.assert_close(full[key], value, atol=1e-5, rtol=0, msg=key)


def _perturb(module):
    if isinstance(module, nn.Linear):
        nn.init.normal_(module.weight)


class SkipNet(nn.Module):
    """Four blocks, the first's output read again by the third: a value skipping stage 1 (edge 0 -> 2)."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c, self.d = nn.Linear(6, 8), nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 3)

    def forward(self, x):
        h0 = torch.tanh(self.a(x))
        h2 = torch.tanh(self.c(torch.tanh(self.b(h0)))) + h0
        return self.d(h2)


@pytest.mark.parametrize("schedule, checkpoint", [("interleaved-1f1b", "never"), ("zb-v", "never"),
                                                  ("interleaved-1f1b", "always")])
def test_a_graph_split_with_a_skip_edge_equals_one_process(schedule, checkpoint):
    # interleaved: stages 0 and 2 on rank 0, the skip edge in memory; zb-v: stage 2 on rank 1, over the wire.
    torch.manual_seed(3)
    model, data = SkipNet(), pipeline_batches(BATCH, STEPS)
    expected_losses, expected_state = pipeline_reference(model, data)
    pipe = DistributedPipeline(copy.deepcopy(model), chunks=4, schedule=schedule, loss_fn=nn.MSELoss(),
                               split_points=["b", "c", "d"], virtual_stages=2, checkpoint=checkpoint)
    assert sorted(pipe.held_stages) == HELD[schedule][hvd.rank()]
    check_pipeline_training(pipe, data, (expected_losses, expected_state))
    trained = copy.deepcopy(model)
    trained.load_state_dict(expected_state)
    with torch.no_grad():
        out = pipe(data[0][0] if pipe.is_first else None)
        if pipe.is_last:
            torch.testing.assert_close(out, trained(data[0][0]), atol=1e-5, rtol=0)
