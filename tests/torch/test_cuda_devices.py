"""Stages on a real GPU and on the CPU of one process (``ModelParallel``, ``Pipeline``): what the CPU suite cannot run.

Skipped where torch sees no CUDA device (CI has none; docs/model_parallel.md says where it was last run).
With one: Hugging Face models from small configs (tests/parallel/hf_cases.py, float64, dropout off) cut inside
their block stacks, stages on ``cuda:0`` and ``cpu`` in both orders; GPT-2 with its head tied to the token
embedding cut at the head, so the tied weight lives on one device and a copy on the other (no
``COPY_ON_ONE_DEVICE``); the loss, every gradient and the weights after 2 SGD steps with momentum equal the unsplit
model's on the CPU to 1e-7 (float64 kernels on the GPU and on the CPU sum in different orders:
seen 1e-9 apart; not Adam, whose step turns such differences in a gradient near zero into a step's size). With dropout on, recomputation (``checkpoint="always"``) draws the forward's
masks again on the GPU: gradients equal those of ``checkpoint="never"`` from the same seed.
"""
import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

import dualframe.torch as hvd  # noqa: E402
from tests.parallel.hf_cases import MODELS, batch, loss_fn, make  # noqa: E402
from tests.parallel.torch_cases import lm_loss, tied_gpt2, token_batches  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

PLACEMENTS = [("cuda:0", "cpu"), ("cpu", "cuda:0")]
TOL = 1e-7


def on(device, value):
    """``value`` (a tensor or a dict of tensors) on ``device``."""
    if isinstance(value, dict):
        return {k: v.to(device) for k, v in value.items()}
    return value.to(device)


def train_both(split, reference, steps, loss_fn):
    """Two SGD steps (momentum) of ``split`` (inputs on the CPU, the target where the output is) and of the
    unsplit ``reference`` on the CPU, checking the loss and every gradient on the way and the weights after."""
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (split, reference))
    for inputs, target in steps:
        opt.zero_grad()
        ref_opt.zero_grad()
        output = split(**inputs) if isinstance(inputs, dict) else split(inputs)
        logits = output["logits"] if isinstance(output, dict) else output.logits
        loss = loss_fn(output, on(logits.device, target))
        expected = loss_fn(reference(**inputs) if isinstance(inputs, dict) else reference(inputs), target)
        loss.backward()
        expected.backward()
        assert loss.item() == pytest.approx(expected.item(), abs=TOL, rel=0)
        for (name, p), q in zip(split.named_parameters(), reference.parameters()):
            if q.grad is None:  # a part the loss does not reach (BERT's pooler)
                assert p.grad is None, name
            else:
                torch.testing.assert_close(p.grad.cpu(), q.grad, atol=TOL, rtol=0, msg=name)
        opt.step()
        ref_opt.step()
    got, want = split.state_dict(), reference.state_dict()
    assert list(got) == list(want)
    for key, value in want.items():
        torch.testing.assert_close(got[key].cpu(), value, atol=TOL, rtol=0, msg=key)


@pytest.mark.parametrize("devices", PLACEMENTS, ids=["gpu-cpu", "cpu-gpu"])
@pytest.mark.parametrize("strategy", [hvd.ModelParallel, hvd.Pipeline])
@pytest.mark.parametrize("name", ["gpt2", "bert", "llama"])
def test_a_transformer_across_the_gpu_and_the_cpu_trains_as_unsplit(name, strategy, devices):
    model = make(name)
    reference = copy.deepcopy(model)
    steps = [batch(name, seed=s) for s in (1, 2)]
    kwargs = dict(chunks=2) if strategy is hvd.Pipeline else {}
    split = strategy(model, split_points=[MODELS[name][1]], devices=list(devices), sample=steps[0][0], **kwargs)
    train_both(split, reference, steps, loss_fn)


@pytest.mark.parametrize("devices", PLACEMENTS, ids=["gpu-cpu", "cpu-gpu"])
@pytest.mark.parametrize("strategy", [hvd.ModelParallel, hvd.Pipeline])
def test_a_head_tied_to_the_embedding_across_devices_trains_as_unsplit(strategy, devices):
    model, data = tied_gpt2(), token_batches()
    reference = copy.deepcopy(model)
    kwargs = dict(chunks=2) if strategy is hvd.Pipeline else {}
    split = strategy(model, split_points=["lm_head"], devices=list(devices), sample=(data[0][0],), **kwargs)
    assert "copy of " in split.describe()
    held = list(split.graph_stages.copies.copies.values())
    assert held and all(h.copy.device != h.master.device for h in held)
    train_both(split, reference, data, lm_loss)


def dropout_gpt2():
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=96, n_positions=32, n_embd=16, n_layer=4, n_head=2, use_cache=False,
                                     resid_pdrop=0.3, embd_pdrop=0.3, attn_pdrop=0.3, tie_word_embeddings=False)
    return transformers.GPT2LMHeadModel(config).double().train()


def gradients(checkpoint, devices):
    model = dropout_gpt2()
    inputs, target = batch("gpt2")
    split = hvd.Pipeline(model, split_points=["transformer.h.2"], devices=list(devices), chunks=2, sample=inputs,
                         checkpoint=checkpoint)
    torch.manual_seed(7)
    torch.cuda.manual_seed_all(7)
    output = split(**inputs)
    loss_fn(output, on(output.logits.device, target)).backward()
    return {n: p.grad.cpu() for n, p in split.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("devices", PLACEMENTS + [("cuda:0", "cuda:0")], ids=["gpu-cpu", "cpu-gpu", "gpu-gpu"])
def test_recomputation_on_the_gpu_draws_the_forwards_dropout_masks(devices):
    never, always = gradients("never", devices), gradients("always", devices)
    assert any(g.abs().sum() > 0 for g in never.values())
    for name, g in never.items():
        torch.testing.assert_close(always[name], g, atol=1e-9, rtol=0, msg=name)
