"""Tied weights across 2 process stages: each holder keeps a copy, their gradients are summed every step.

GPT-2 (transformers, a tiny config, float64) cut at ``lm_head``, whose weight is ``transformer.wte.weight``
on stage 0, and a small model whose first and last layers share one weight (as a graph and as an
``nn.Sequential``): the loss of each of 2 SGD steps and every weight after them equal one process
training the unsplit model (1e-9), and the stages' state dicts merge into the model's own keys.
"""
# np: 2
# timeout: 400
import copy
import tempfile

import horovod.torch as horovod
import pytest
import torch
from torch import nn

import dualframe.torch as hvd
from dualframe.errors import StrategyError
from dualframe.torch.pipeline.distributed import DistributedPipeline

from torch_cases import float_batches, lm_loss, shared_ends, tied_gpt2, token_batches  # tests/parallel on sys.path

STEPS = 2


def mse(output, target):
    return nn.functional.mse_loss(output, target)


@pytest.fixture(scope="module", autouse=True)
def started():
    hvd.init()
    assert hvd.size() == 2


def train_both(model, data, loss_fn, **split):
    """Losses and merged state dict of the pipeline, and the unsplit reference's, after SGD steps on ``data``."""
    reference = copy.deepcopy(model)
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.5)
    pipe = DistributedPipeline(model, chunks=2, loss_fn=loss_fn, **split)
    optimizer = torch.optim.SGD(pipe.parameters(), lr=0.5)
    losses, expected = [], []
    for x, y in data:
        ref_optimizer.zero_grad()
        loss = loss_fn(reference(x), y)
        loss.backward()
        ref_optimizer.step()
        expected.append(loss.item())
        optimizer.zero_grad()
        losses.append(pipe.train_step(x, y))
        optimizer.step()
    merged = {}
    for part in horovod.allgather_object(pipe.state_dict()):
        for key, value in part.items():
            if key in merged:  # a tied weight: every holder's copy is the same
                torch.testing.assert_close(value, merged[key], atol=1e-12, rtol=0, msg=key)
            merged[key] = value
    return pipe, losses, expected, merged, reference.state_dict()


def check(losses, expected, merged, reference):
    assert losses == pytest.approx(expected, abs=1e-9)
    assert set(merged) == set(reference)
    for key, value in reference.items():
        torch.testing.assert_close(merged[key], value, atol=1e-9, rtol=0, msg=key)


def check_checkpoint(pipe, reference):
    """Stage checkpoints merge into the model's keys (each tied name once), equal to the reference."""
    folder = horovod.broadcast_object(tempfile.mkdtemp() if hvd.rank() == 0 else None, 0, name="folder")
    hvd.save_stage_checkpoint(f"{folder}/ckpt", pipe, step=STEPS - 1)
    mine = f"{folder}/full-{hvd.rank()}.pt"  # every rank merges (one process, no communication)
    hvd.merge_stage_checkpoints(f"{folder}/ckpt", mine)
    full = torch.load(mine, weights_only=True)["model"]
    assert set(full) == set(reference)
    for key, value in reference.items():
        torch.testing.assert_close(full[key], value, atol=1e-9, rtol=0, msg=key)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_gpt2_cut_at_its_tied_head_trains_as_one_process(schedule):
    model = tied_gpt2()
    ids = token_batches()
    pipe, losses, expected, merged, reference = train_both(model, ids, lm_loss, split_points=["lm_head"],
                                                           sample=(ids[0][0],), schedule=schedule)
    assert [w.names for w in pipe.tied.plan.tied] == [("transformer.wte.weight", "lm_head.weight")]
    check(losses, expected, merged, reference)
    check_checkpoint(pipe, reference)


def test_gpt2_cut_inside_the_blocks_trains_as_one_process():
    ids = token_batches()
    _, losses, expected, merged, reference = train_both(tied_gpt2(), ids, lm_loss, split_points=["transformer.h.1"],
                                                        sample=(ids[0][0],))
    check(losses, expected, merged, reference)


@pytest.mark.parametrize("sequential", [False, True], ids=["graph", "sequential"])
def test_first_and_last_layer_sharing_a_weight_train_as_one_process(sequential):
    model = shared_ends(sequential)
    split = {"balance": [2, 3]} if sequential else {"split_points": ["mid"]}
    pipe, losses, expected, merged, reference = train_both(model, float_batches(), mse, **split)
    assert [w.stages for w in pipe.tied.plan.tied] == [(0, 1)]
    check(losses, expected, merged, reference)
    check_checkpoint(pipe, reference)


def test_copies_start_equal_and_load_from_the_model_keys():
    model = shared_ends(False)
    if hvd.rank() == 1:  # a copy that drifted: the broadcast at build makes it stage 0's again
        with torch.no_grad():
            model.first.weight.add_(1.0)
    pipe = DistributedPipeline(model, loss_fn=mse, split_points=["mid"])
    root = horovod.broadcast(pipe.state_dict()["first.weight"], 0, name="root_copy")
    torch.testing.assert_close(pipe.state_dict()["last.weight"], root, atol=0, rtol=0)
    for shard in ("optimizer", "parameters"):
        with pytest.raises(StrategyError, match=rf"shard='{shard}' cannot keep the copies of .*first.weight"):
            pipe.distributed_optimizer(torch.optim.SGD(pipe.parameters(), lr=0.1), shard=shard)
    fresh = shared_ends(False).state_dict()
    pipe.load_state_dict(fresh)  # strict: the stage's keys, the tied one under either of its names
    for key, value in pipe.state_dict().items():
        torch.testing.assert_close(value, fresh[key], atol=0, rtol=0, msg=key)
