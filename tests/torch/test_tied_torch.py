"""A weight shared by stages in one process (ModelParallel, Pipeline) trains as the unsplit model; tied weights found.

GPT-2 (transformers, tiny, float64) cut at its tied ``lm_head`` and a model whose first and last layers
share one weight, on "cpu" twice: the loss of 2 SGD steps and every weight after them equal the unsplit
model's (1e-9), and ``state_dict()`` has the model's keys (the tied weight under both names).
"""
import copy

import pytest
import torch
from torch import nn

import dualframe.torch as hvd
from dualframe.torch.pipeline.graph import GraphPart
from dualframe.torch.split.tied import find_stage_tied, model_state_dict, stage_part, tensor_names
from tests.parallel.torch_cases import float_batches, lm_loss, shared_ends, tied_gpt2, token_batches


def train(model, data, loss_fn, steps_of=None):
    """Per-step losses and the final state dict of SGD on ``data`` (``steps_of``: the module the batches go through)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for x, y in data:
        optimizer.zero_grad()
        loss = loss_fn((steps_of or model)(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, model.state_dict()


def assert_same_training(split, reference, data, loss_fn):
    expected, want = train(reference, data, loss_fn)
    losses, got = train(split, data, loss_fn)
    assert losses == pytest.approx(expected, abs=1e-9)
    assert list(got) == list(want)
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, atol=1e-9, rtol=0, msg=key)


@pytest.mark.parametrize("strategy", [hvd.ModelParallel, hvd.Pipeline])
def test_gpt2_cut_at_its_tied_head_trains_as_the_unsplit_model(strategy):
    model, data = tied_gpt2(), token_batches()
    reference = copy.deepcopy(model)
    split = strategy(model, split_points=["lm_head"], devices=["cpu", "cpu"], chunks=2, sample=(data[0][0],))
    assert_same_training(split, reference, data, lm_loss)


def test_gpt2_cut_inside_the_blocks_trains_as_the_unsplit_model():
    model, data = tied_gpt2(), token_batches()
    reference = copy.deepcopy(model)
    split = hvd.Pipeline(model, split_points=["transformer.h.1", "lm_head"], devices=["cpu"] * 3, chunks=2,
                         sample=(data[0][0],))
    assert_same_training(split, reference, data, lm_loss)


@pytest.mark.parametrize("strategy", [hvd.ModelParallel, hvd.Pipeline])
def test_first_and_last_layer_sharing_a_weight_train_as_the_unsplit_model(strategy):
    model = shared_ends()
    reference = copy.deepcopy(model)
    split = strategy(model, split_points=["mid", "last"], devices=["cpu"] * 3, chunks=2)
    assert "tied: first.weight = last.weight, read by stages 0, 2" in split.describe()
    assert_same_training(split, reference, float_batches(), nn.functional.mse_loss)


def test_tied_weights_are_found_by_identity_under_every_name():
    model, ids = tied_gpt2(), token_batches()[0][0]
    part = GraphPart(model, split_points=["lm_head"], sample=(ids,))
    stages = [part.module(0), part.module(1)]
    (tied,) = find_stage_tied(model, stages)
    assert (tied.names, tied.stages) == (("transformer.wte.weight", "lm_head.weight"), (0, 1))
    names = tensor_names(model)
    merged = {**model_state_dict(stages[0], names), **model_state_dict(stages[1], names)}
    assert set(merged) == set(model.state_dict())  # torch.export's stage names it lm_head.weight only
    assert set(stage_part(stages[1], names, {"transformer.wte.weight": 0})) == {"lm_head.weight"}
    assert find_stage_tied(shared_ends(), [shared_ends()]) == []
