"""Hybrid on 4 processes: 2 replicas x 2 stages, against one process training the whole model on the global batch.

Also the hybrid's stage checkpoints: k steps, save (one writer per stage), a fresh perturbed pipeline
on every rank, load (broadcast among each stage's replicas), the remaining steps == the straight run;
the merged stages == one process.
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
from dualframe.pipeline.layout import pipeline_process_sets
from dualframe.torch.dp.shard import blocks as shard_blocks
from dualframe.torch.pipeline.distributed import DistributedPipeline

STEPS, GLOBAL_BATCH = 3, 16
ALLGATHER_INTO = shard_blocks.allgather_into


def make_model():
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(5, 12), nn.Tanh(), nn.Linear(12, 12), nn.Tanh(), nn.Linear(12, 2))


def batches(seed, steps=STEPS):
    """``steps`` global batches (inputs, targets)."""
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randn(GLOBAL_BATCH, 5, generator=generator), torch.randn(GLOBAL_BATCH, 2, generator=generator))
            for _ in range(steps)]


def reference_step(reference, ref_optimizer, x, y):
    """One step of the unsplit model on the global batch, in one process; its loss."""
    ref_optimizer.zero_grad()
    loss = nn.functional.mse_loss(reference(x), y)
    loss.backward()
    ref_optimizer.step()
    return loss.item()


def replica_step(pipe, optimizer, x, y):
    """One step of the hybrid: each replica its half of the global batch; the mean loss."""
    rows = len(x) // 2
    shard = slice(pipe.replica * rows, (pipe.replica + 1) * rows)
    optimizer.zero_grad()
    loss = pipe.train_step(x[shard], y[shard])
    optimizer.step()
    return loss


def merged_state(pipe):
    """Replica 0's stages' state dicts joined (every rank calls it: an allgather)."""
    merged = {}
    for part in horovod.allgather_object((pipe.replica, pipe.state_dict())):
        if part[0] == 0:
            merged.update(part[1])
    return merged


@pytest.fixture(scope="module", autouse=True)
def started():
    # The process sets the pipeline needs, declared at start-up: pairs and replicas of each stage.
    hvd.init(process_sets=pipeline_process_sets(4, 2))
    assert hvd.size() == 4


@pytest.mark.parametrize("schedule, shard, checkpoint", [("gpipe", None, "never"), ("1f1b", "gradients", "never"),
                                                        ("zb-h1", None, "never"), ("1f1b", "gradients", "always")])
def test_hybrid_equals_one_process_on_the_global_batch(schedule, shard, checkpoint):
    """With shard=, each stage's optimizer state and gradients are sharded among that stage's replicas;
    with checkpoint=, each stage recomputes its micro-batches' forward in their backward."""
    model = make_model()
    reference = copy.deepcopy(model)
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.2)
    pipe = DistributedPipeline(copy.deepcopy(model), balance=[3, 2], chunks=4, schedule=schedule,
                               loss_fn=nn.MSELoss(), data_parallel=2, checkpoint=checkpoint)
    assert (pipe.replica, pipe.stage_index) == divmod(hvd.rank(), 2)
    optimizer = pipe.distributed_optimizer(torch.optim.SGD(pipe.parameters(), lr=0.2), shard=shard)
    assert getattr(optimizer, "ranks", 2) == 2  # sharded among the 2 replicas of the stage
    for step, (x, y) in enumerate(batches(5)):
        expected = reference_step(reference, ref_optimizer, x, y)
        assert replica_step(pipe, optimizer, x, y) == pytest.approx(expected, abs=1e-5), f"step {step}"
    merged = merged_state(pipe)
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(merged[key], value, atol=1e-5, rtol=0)
    for key, value in pipe.state_dict().items():  # both replicas of a stage hold the same weights
        torch.testing.assert_close(value, reference.state_dict()[key], atol=1e-5, rtol=0)


OPTIMIZERS = {"sgd": lambda params: torch.optim.SGD(params, lr=0.2, momentum=0.9),
              "adam": lambda params: torch.optim.Adam(params, lr=0.05)}


def state_bytes(state):
    return sum(v.numel() * v.element_size() for entry in state.values() for v in entry.values()
               if isinstance(v, torch.Tensor) and v.dim() > 0)


@pytest.mark.parametrize("name, schedule, checkpoint", [("sgd", "gpipe", "never"), ("adam", "1f1b", "always"),
                                                        ("adam", "zb-h1", "never")])
def test_zero3_hybrid_equals_one_process_and_holds_half_between_steps(name, schedule, checkpoint, monkeypatch):
    """shard="parameters": each replica keeps 1/2 of its stage's parameters, gradients and optimizer state
    between steps; the stage is gathered once per step and its gradients reduced once per step."""
    model = make_model()
    reference = copy.deepcopy(model)
    ref_optimizer = OPTIMIZERS[name](reference.parameters())
    pipe = DistributedPipeline(copy.deepcopy(model), balance=[3, 2], chunks=4, schedule=schedule,
                               loss_fn=nn.MSELoss(), data_parallel=2, checkpoint=checkpoint)
    optimizer = pipe.distributed_optimizer(OPTIMIZERS[name](pipe.parameters()), shard="parameters")
    assert optimizer.ranks == 2 and optimizer.shard == "parameters"
    gathers, reduces, reduce_bucket = [], [], optimizer._reduce_bucket
    monkeypatch.setattr(shard_blocks, "allgather_into", lambda *args: gathers.append(1) or ALLGATHER_INTO(*args))
    optimizer._reduce_bucket = lambda slot: reduces.append(1) or reduce_bucket(slot)
    own = dict(reference.named_parameters())
    stage = [own[key] for key, _ in pipe.named_parameters()]  # the stage's parameters, in the unsplit model
    for step, (x, y) in enumerate(batches(7)):
        expected = reference_step(reference, ref_optimizer, x, y)
        assert replica_step(pipe, optimizer, x, y) == pytest.approx(expected, abs=1e-5), f"step {step}"
        optimizer.zero_grad()
        # Between steps: no full parameter present; half the stage's weights and optimizer state (+ padding:
        # at most one element per bucket, its parameter and each state entry).
        plain = sum(p.numel() * p.element_size() for p in stage) + state_bytes(
            {p: ref_optimizer.state[p] for p in stage})
        padding = 4 * len(optimizer._slots) * (1 + len(next(iter(optimizer.state.values()))))
        assert all(p.untyped_storage().nbytes() == 0 for p in pipe.parameters())
        assert abs(optimizer.held_bytes() - plain / 2) <= padding, (optimizer.held_bytes(), plain)
    monkeypatch.undo()
    slots = len(optimizer._slots)  # one gather and one reduction of each bucket per step, whatever the chunks
    assert (len(gathers), len(reduces)) == (slots * STEPS, slots * STEPS)
    x = batches(8, 1)[0][0][pipe.replica * 8:(pipe.replica + 1) * 8]
    out = pipe(x)  # inference: gathered for the walk, freed after
    assert all(p.untyped_storage().nbytes() == 0 for p in pipe.parameters())
    if pipe.is_last:
        torch.testing.assert_close(out, reference(x).detach(), atol=1e-5, rtol=0)
    full = optimizer.state_dict()  # the unsharded optimizer's format (a collective of the stage's replicas)
    own = dict(reference.named_parameters())
    for i, p in enumerate(stage):
        for entry, value in full["state"][i].items():
            torch.testing.assert_close(value, ref_optimizer.state[p][entry], atol=1e-5, rtol=0)
    merged = merged_state(pipe)
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(merged[key], value, atol=1e-5, rtol=0)


def test_zero3_hybrid_with_backward_passes_per_step_equals_the_unsharded_hybrid():
    """Two train_steps per step: the stage stays gathered across both, each bucket reduced once after the second."""
    weights = {}
    for shard in (None, "parameters"):
        pipe = DistributedPipeline(make_model(), balance=[3, 2], chunks=2, schedule="1f1b", loss_fn=nn.MSELoss(),
                                   data_parallel=2)
        optimizer = pipe.distributed_optimizer(OPTIMIZERS["adam"](pipe.parameters()), shard=shard,
                                               backward_passes_per_step=2)
        reduces, reduce_bucket = [], getattr(optimizer, "_reduce_bucket", None)
        if shard is not None:
            optimizer._reduce_bucket = lambda slot: reduces.append(1) or reduce_bucket(slot)
        for x, y in batches(9):
            optimizer.zero_grad()
            for part in (slice(0, 8), slice(8, 16)):  # each replica's rows of each of the two passes
                rows = slice(part.start + pipe.replica * 4, part.start + pipe.replica * 4 + 4)
                pipe.train_step(x[rows], y[rows])
            optimizer.step()
        assert shard is None or len(reduces) == len(optimizer._slots) * STEPS
        weights[shard] = pipe.state_dict()
    for key, value in weights[None].items():
        torch.testing.assert_close(weights["parameters"][key], value, atol=1e-5, rtol=0, msg=key)


def test_zero3_hybrid_refusals_before_any_message():
    """(Virtual stages run no replicas yet: dualframe.dp.zero3.check_stage_sharding refuses them, its doctest.)"""
    pipe = DistributedPipeline(make_model(), balance=[3, 2], chunks=4, loss_fn=nn.MSELoss(), data_parallel=2)
    with pytest.raises(StrategyError, match="keep_gathered= has no use in a pipeline stage"):
        pipe.distributed_optimizer(torch.optim.SGD(pipe.parameters(), lr=0.2), shard="parameters", keep_gathered=1)
    with pytest.raises(StrategyError, match="model= is the stage itself"):
        pipe.distributed_optimizer(torch.optim.SGD(pipe.parameters(), lr=0.2), shard="parameters", model=pipe)
    pipe.distributed_optimizer(torch.optim.SGD(pipe.parameters(), lr=0.2), shard="parameters")
    with pytest.raises(StrategyError, match="sharded by its shard='parameters' optimizer already"):
        pipe.distributed_optimizer(torch.optim.SGD(pipe.parameters(), lr=0.2))


RESUME_STEPS, SAVE_AFTER = 4, 2


def hybrid_run(seed, momentum=0.9, shard=None):
    """A hybrid pipeline + its distributed SGD with momentum; weights perturbed by ``seed`` (0: the model's own)."""
    pipe = DistributedPipeline(make_model(), balance=[3, 2], chunks=4, schedule="1f1b", loss_fn=nn.MSELoss(),
                               data_parallel=2)
    if seed:  # every rank its own wrong weights: only a load that reaches every replica puts them right
        generator = torch.Generator().manual_seed(seed + hvd.rank())
        with torch.no_grad():
            for parameter in pipe.parameters():
                parameter.add_(torch.randn(parameter.shape, generator=generator))
    return pipe, pipe.distributed_optimizer(torch.optim.SGD(pipe.parameters(), lr=0.1, momentum=momentum),
                                            shard=shard)


@pytest.mark.parametrize("shard", [None, "gradients", "parameters"])
def test_hybrid_stage_checkpoint_resume_and_merge(tmp_path, shard):
    """With shard= too: every replica gathers the stage's state, its first rank writes the full tensors and the
    unsharded optimizer state."""
    folder = horovod.broadcast_object(str(tmp_path), 0, name="hybrid.ckpt.folder")  # one folder for all ranks
    ckpt = os.path.join(folder, "ckpt")
    data = batches(11, RESUME_STEPS)
    pipe, optimizer = hybrid_run(0, shard=shard)
    straight_losses = [replica_step(pipe, optimizer, x, y) for x, y in data]
    straight = copy.deepcopy(pipe.state_dict())

    pipe, optimizer = hybrid_run(0, shard=shard)
    for x, y in data[:SAVE_AFTER]:
        replica_step(pipe, optimizer, x, y)
    torch.manual_seed(100 + hvd.rank())  # each rank its own RNG stream, saved with its stage
    written = hvd.save_stage_checkpoint(ckpt, pipe, optimizer, step=SAVE_AFTER - 1,
                                        data_position={"next_step": SAVE_AFTER})
    assert (written is not None) == (pipe.replica == 0), f"rank {hvd.rank()} wrote {written}"
    saved, draw = copy.deepcopy(pipe.state_dict()), torch.rand(3)
    assert sorted(os.listdir(ckpt)) == ["stage-0", "stage-1"]

    pipe, optimizer = hybrid_run(77, shard=shard)  # fresh, perturbed, no momentum yet, another RNG stream
    torch.manual_seed(999)
    state = hvd.load_stage_checkpoint(ckpt, pipe, optimizer)
    assert state.step == SAVE_AFTER - 1 and state.data_position == {"next_step": SAVE_AFTER}, state
    for key, value in saved.items():  # every replica holds exactly what the stage's writer saved
        torch.testing.assert_close(pipe.state_dict()[key], value, atol=0, rtol=0, msg=f"rank {hvd.rank()}: {key}")
    torch.testing.assert_close(torch.rand(3), draw, atol=0, rtol=0, msg=f"rank {hvd.rank()}: RNG not restored")
    for step in range(SAVE_AFTER, RESUME_STEPS):
        loss = replica_step(pipe, optimizer, *data[step])
        assert loss == pytest.approx(straight_losses[step], abs=1e-5), f"step {step} after resuming"
    for key, value in straight.items():
        torch.testing.assert_close(pipe.state_dict()[key], value, atol=1e-5, rtol=0, msg=f"rank {hvd.rank()}: {key}")
    if shard is not None and written is not None:  # read without dualframe: full tensors, the plain optimizer's format
        content = torch.load(written, weights_only=False)
        assert sorted(content["model"]) == sorted(saved) and len(content["optimizer"]["state"]) == len(saved)
        for key, value in saved.items():
            torch.testing.assert_close(content["model"][key], value, atol=0, rtol=0)
    check_merged(ckpt, folder, pipe, data, straight_losses)


def check_merged(ckpt, folder, pipe, data, straight_losses):
    """Save the end, merge the stages; the full model == one process; every stage loads rank 0's merged file."""
    hvd.save_stage_checkpoint(ckpt, pipe, step=RESUME_STEPS - 1, data_position={"next_step": RESUME_STEPS})
    reference = make_model()
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    for step, (x, y) in enumerate(data):
        loss = reference_step(reference, ref_optimizer, x, y)
        assert loss == pytest.approx(straight_losses[step], abs=1e-5), f"step {step}: hybrid vs one process"
    mine = os.path.join(folder, f"full-{hvd.rank()}.pt")  # every rank merges (one process, no communication) and checks alike
    hvd.merge_stage_checkpoints(ckpt, mine)
    full = make_model()
    full.load_state_dict(torch.load(mine, weights_only=True)["model"], strict=True)
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(full.state_dict()[key], value, atol=1e-5, rtol=0, msg=f"merged {key}")
    again, _ = hybrid_run(55)
    assert hvd.load_stage_checkpoint(os.path.join(folder, "full-0.pt"), again).step == RESUME_STEPS - 1
    for key, value in pipe.state_dict().items():
        torch.testing.assert_close(again.state_dict()[key], value, atol=0, rtol=0, msg=f"rank {hvd.rank()}: {key}")
