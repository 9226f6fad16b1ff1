"""DistributedPipeline over Hugging Face ``transformers`` models on 2 processes: GPT-2, BERT with a padded mask, a
Llama-style decoder, a mixture of experts (Mixtral) and an encoder-decoder (T5), cut inside the block stack and
at the head.

torch.export captures each (torch.fx cannot trace them); the values crossing a cut inside the stack include
the traced batch size (``sym_size_int``), which crosses as data beside the tensors. float64, dropout off:
every step's loss and the weights after 2 SGD steps equal one process training the unsplit model, to 1e-9.
GPT-2 given its labels among its inputs trains on its own loss (``loss_fn=None``; transformers computes it
in float32: 1e-6), the weights to 1e-9. Models: tests/parallel/hf_cases.py (GPT-2 without tied weights).
"""
# timeout: 500
import copy

import horovod.torch as horovod
import pytest
import torch

import dualframe.torch as hvd
from dualframe.torch.pipeline.distributed import DistributedPipeline
from dualframe.errors import StrategyError
from hf_cases import MODELS, batch, labelled, loss_fn, make  # tests/parallel is on sys.path (pytest rootdir import)

STEPS, LR = 2, 0.5


@pytest.fixture(scope="module", autouse=True)
def started():
    hvd.init()
    assert hvd.size() == 2


def reference_run(model, data):
    """Each step's loss and the weights after the steps, training the unsplit model in one process."""
    model = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for inputs, target in data:
        optimizer.zero_grad()
        loss = loss_fn(model(**inputs), target)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, model.state_dict()


CASES = [(name, MODELS[name][1], "gpipe") for name in MODELS] + [
    ("gpt2", MODELS["gpt2"][2], "1f1b"), ("t5", MODELS["t5"][2], "1f1b")]


@pytest.mark.parametrize("name, cut, schedule", CASES, ids=[f"{n}-{c}-{s}" for n, c, s in CASES])
def test_training_equals_the_unsplit_model(name, cut, schedule):
    model = make(name)
    data = [batch(name, seed=step) for step in range(STEPS)]
    expected, weights = reference_run(model, data)
    pipe = DistributedPipeline(copy.deepcopy(model), chunks=2, schedule=schedule, loss_fn=loss_fn,
                               split_points=[cut], sample=data[0][0])
    optimizer = torch.optim.SGD(pipe.parameters(), lr=LR)
    for step, (inputs, target) in enumerate(data):
        optimizer.zero_grad()
        if step == 0:  # the batch as a dict of keyword inputs ...
            loss = pipe.train_step(inputs if pipe.is_first else None, target if pipe.is_last else None)
        else:  # ... or as keywords
            loss = pipe.train_step(targets=target if pipe.is_last else None, **(inputs if pipe.is_first else {}))
        assert loss == pytest.approx(expected[step], abs=1e-9, rel=0), f"step {step}"
        optimizer.step()
    merged = {}
    for part in horovod.allgather_object(pipe.state_dict()):
        merged.update(part)
    assert sorted(merged) == sorted(weights)  # non-persistent buffers (BERT's position_ids) stay out
    for key, value in weights.items():
        torch.testing.assert_close(merged[key], value, atol=1e-9, rtol=0, msg=key)


def test_stages_2_cuts_in_the_middle_of_the_decoder_and_loads_the_models_state_dict():
    model = make("bert")
    inputs, target = batch("bert")
    pipe = DistributedPipeline(copy.deepcopy(model), stages=2, loss_fn=loss_fn, sample=inputs)
    assert pipe.graph.split.split_points == ("bert.encoder.layer.2",)
    pipe.load_state_dict(model.state_dict())  # the model's own keys, without its non-persistent buffers
    expected, _ = reference_run(model, [(inputs, target)])
    loss = pipe.train_step(inputs if pipe.is_first else None, target if pipe.is_last else None)
    assert loss == pytest.approx(expected[0], abs=1e-9, rel=0)
    with torch.no_grad():
        out = pipe(**inputs) if pipe.is_first else pipe(None)
        ref = model(**inputs)
    if pipe.is_last:
        torch.testing.assert_close(out.logits, ref.logits, atol=1e-9, rtol=0)
    else:
        assert out is None
    pipe.loss_fn = None  # the model's own loss: its sample had no labels, so its output holds none
    with pytest.raises(StrategyError, match=r"the model's output \(captured on the sample\) holds no loss of its own"):
        pipe.train_step(inputs if pipe.is_first else None)


def test_labels_among_the_inputs_train_on_the_models_own_loss():
    model = make("gpt2")
    data = [labelled("gpt2", seed=step) for step in range(STEPS)]
    reference = copy.deepcopy(model)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=LR)
    pipe = DistributedPipeline(copy.deepcopy(model), chunks=3, split_points=["transformer.h.2"], sample=data[0])
    optimizer = torch.optim.SGD(pipe.parameters(), lr=LR)
    for inputs in data:  # the labels go from stage 0 to the stage computing the loss, like any input
        optimizer.zero_grad()
        ref_opt.zero_grad()
        loss = pipe.train_step(inputs if pipe.is_first else None)
        expected = reference(**inputs).loss
        expected.backward()
        assert loss == pytest.approx(expected.item(), abs=1e-6, rel=0)
        optimizer.step()
        ref_opt.step()
    merged = {}
    for part in horovod.allgather_object(pipe.state_dict()):
        merged.update(part)
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(merged[key], value, atol=1e-9, rtol=0, msg=key)
    with torch.no_grad():
        out = pipe(**data[0]) if pipe.is_first else pipe(None)
        if pipe.is_last:
            assert out.loss.item() == pytest.approx(reference(**data[0]).loss.item(), abs=1e-6, rel=0)
    with pytest.raises(StrategyError, match=r"the last stage got targets, but the loss is the model's own"):
        pipe.train_step(data[0] if pipe.is_first else None, data[0]["labels"] if pipe.is_last else None)
