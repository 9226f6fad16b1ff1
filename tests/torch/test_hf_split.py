"""Hugging Face ``transformers`` models split in one process: equal to the unsplit model, keyword inputs, units that
count blocks, and no split that would silently lose gradients.

Models from small configs, float64, dropout off (tests/parallel/hf_cases.py): loss and every parameter's
gradient of ``Pipeline`` (2 stages, 2 micro-batches) equal the unsplit model's to 1e-9.
"""
import copy

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

import dualframe.torch as hvd  # noqa: E402
from dualframe.errors import StrategyError, TraceError  # noqa: E402
from dualframe.torch.pipeline.graph import GraphPart  # noqa: E402
from dualframe.torch.pipeline.graph_work import pack, unpack  # noqa: E402
from tests.parallel.hf_cases import MODELS, batch, labelled, loss_fn, make, reference_grads  # noqa: E402

CUTS = [(name, cut) for name, (_, inside, head) in MODELS.items() for cut in (inside, head)]


@pytest.mark.parametrize("name, cut", CUTS, ids=[f"{n}-{c}" for n, c in CUTS])
def test_loss_and_every_gradient_equal_the_unsplit_model(name, cut):
    model = make(name)
    inputs, target = batch(name)
    expected, grads = reference_grads(model, inputs, target)
    split = hvd.Pipeline(model, split_points=[cut], devices=["cpu", "cpu"], chunks=2, sample=inputs)
    assert split.graph_stages.captured.method == "export"
    loss = loss_fn(split(**inputs), target)
    loss.backward()
    assert float(loss) == pytest.approx(expected, abs=1e-9, rel=0)
    for n, p in split.named_parameters():
        if grads[n] is None:
            assert p.grad is None, n
        else:
            torch.testing.assert_close(p.grad, grads[n], atol=1e-9, rtol=0, msg=n)


@pytest.mark.parametrize("name", list(MODELS))
def test_balance_counts_the_blocks_and_describe_names_modules(name):
    model = make(name)
    inputs, _ = batch(name)
    split = hvd.ModelParallel(model, balance=[2, 2] if name != "moe" else [1, 2], devices=["cpu", "cpu"],
                              sample=inputs)
    assert split.split_points == [MODELS[name][1]]  # everything outside the blocks joins its neighbour block
    text = split.describe()
    assert "_empty_nn_module_stack" not in text and "sym_size_int" in text, text
    assert "no tensor (a size, a flag or None: sent as data)" in text, text


def test_gpt2_stages_2_cuts_in_the_middle_of_the_decoder():
    model = make("gpt2")
    inputs, _ = batch("gpt2")
    assert GraphPart(model, stages=2, sample=inputs).split.split_points == ("transformer.h.2",)
    split = hvd.ModelParallel(copy.deepcopy(model), stages=2, devices=["cpu", "cpu"], sample=inputs, by="memory")
    assert split.split_points == ["transformer.h.2"], split.describe()


def test_non_persistent_buffers_stay_out_of_the_state_dict():
    model = make("bert")
    inputs, _ = batch("bert")
    keys = list(model.state_dict())
    assert "bert.embeddings.position_ids" not in keys
    split = hvd.ModelParallel(copy.deepcopy(model), split_points=["bert.encoder.layer.2"], devices=["cpu", "cpu"],
                              sample=inputs)
    assert list(split.state_dict()) == keys
    split.load_state_dict(model.state_dict())
    part = GraphPart(copy.deepcopy(model), split_points=["bert.encoder.layer.2"], sample=inputs)
    merged = {}
    for j in range(2):
        stage = part.module(j)
        merged.update({key: stage.state_dict()[held] for held, key in part.model_keys(stage)})
    assert sorted(merged) == sorted(keys)  # every entry, the parameter no forward reads included


def test_keyword_inputs_and_flags_are_checked_against_the_sample():
    model = make("bert")
    inputs, _ = batch("bert")
    split = hvd.ModelParallel(copy.deepcopy(model), split_points=["bert.encoder.layer.1"], devices=["cpu", "cpu"],
                              sample={**inputs, "return_dict": True})
    ids, mask = inputs["input_ids"], inputs["attention_mask"]
    expected = model(input_ids=ids, attention_mask=mask).logits
    with torch.no_grad():
        for out in (split(ids, mask, return_dict=True), split(attention_mask=mask, input_ids=ids, return_dict=True)):
            torch.testing.assert_close(out.logits, expected, atol=1e-9, rtol=0)
        with pytest.raises(TypeError, match=r"captured \(torch.export\) with the inputs \(input_ids, attention_mask\)"):
            split(input_ids=ids, return_dict=True)
        with pytest.raises(TypeError, match=r"captured with the flags \{'return_dict': True\}"):
            split(input_ids=ids, attention_mask=mask, return_dict=False)


def test_messages_carry_sizes_flags_and_none_beside_tensors():
    values = [torch.randn(2, 3, dtype=torch.float64), 5, (None, True, 2.5), {"shape": torch.Size([2, 3])},
              torch.ones(2, dtype=torch.bool)]
    got = unpack(pack(values, list("abcde"), torch.device("cpu")))
    assert got[1:4] == values[1:4] and isinstance(got[3]["shape"], torch.Size)
    assert torch.equal(got[0], values[0]) and torch.equal(got[4], values[4])
    grads = [torch.zeros(2, 3, dtype=torch.float64), 5, (None, True, 2.5), {"shape": torch.Size([2, 3])},
             torch.zeros(2, dtype=torch.bool)]  # a gradient message: the same layout, so the same size
    assert pack(grads, list("abcde"), torch.device("cpu")).numel() == pack(values, list("abcde"), "cpu").numel()
    with pytest.raises(StrategyError, match=r"value 'c' crosses between process stages and holds a object"):
        pack([torch.ones(1), 3, object()], list("abc"), torch.device("cpu"))


class StraightThrough(torch.autograd.Function):
    """Rounds forward; backward passes the gradient through unchanged (not the derivative of its forward)."""

    @staticmethod
    def forward(ctx, x):
        return torch.round(x * 4) / 4

    @staticmethod
    def backward(ctx, grad):
        return grad


class Custom(nn.Module):
    """A custom autograd Function inside, and a shape branch that fx cannot trace (so torch.export captures it)."""

    def __init__(self, frozen_region=False):
        super().__init__()
        self.a, self.b, self.head = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 2)
        self.scale = nn.Parameter(torch.ones(4))
        self.frozen_region = frozen_region

    def forward(self, x):
        h = self.a(x)
        if h.shape[-1] == 4:
            if self.frozen_region:
                with torch.no_grad():  # the model itself gives self.scale no gradient
                    h = h * self.scale
            else:
                h = StraightThrough.apply(h * self.scale)
        return self.head(self.b(h))


def test_a_custom_autograd_function_is_refused_naming_the_module():
    with pytest.raises(TraceError, match=r"Custom cannot be split: traced by torch.export, 3 of its 7 trainable "
                                         r"parameters would not .*\ba \(Linear\).*Function \(StraightThrough\)"):
        hvd.ModelParallel(Custom(), split_points=["b"], devices=["cpu", "cpu"], sample=torch.randn(3, 4))
    model = Custom(frozen_region=True)  # a no-grad region the unsplit model has too: no gradient either way
    split = hvd.ModelParallel(copy.deepcopy(model), split_points=["b"], devices=["cpu", "cpu"], sample=torch.randn(3, 4))
    x = torch.randn(5, 4)
    split(x).sum().backward()
    model(x).sum().backward()
    for (n, p), q in zip(split.named_parameters(), model.parameters()):
        assert (p.grad is None) == (q.grad is None), n
        if q.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, atol=1e-6, rtol=0, msg=n)


def test_reformer_whose_layers_run_in_a_custom_function_is_refused():
    torch.manual_seed(0)
    config = transformers.ReformerConfig(
        vocab_size=96, hidden_size=16, num_attention_heads=2, attention_head_size=8, feed_forward_size=32,
        attn_layers=["local", "local"], axial_pos_embds=False, max_position_embeddings=32, local_attn_chunk_length=4,
        hidden_dropout_prob=0.0, local_attention_probs_dropout_prob=0.0, is_decoder=True, use_cache=False,
        tie_word_embeddings=False)
    model = transformers.ReformerModelWithLMHead(config).double()
    with pytest.raises(TraceError, match=r"ReformerModelWithLMHead cannot be split: traced by torch.export, \d+ of its "
                                         r"\d+ .*reformer.embeddings.word_embeddings \(Embedding\).*ReversibleFunction"):
        hvd.ModelParallel(model, split_points=["reformer.encoder.layers.1"], devices=["cpu", "cpu"],
                          sample={"input_ids": torch.randint(0, 96, (2, 8))})


@pytest.mark.parametrize("strategy", [hvd.ModelParallel, hvd.Pipeline])
def test_labels_among_the_inputs_give_the_models_own_loss(strategy):
    """The output's ``loss`` over 3 micro-batches is their row-weighted mean; 2 SGD steps with momentum on it.

    transformers computes its loss in float32 (it casts the logits), so the loss agrees to 1e-6; the
    gradients and weights, float64, to 1e-9.
    """
    model, data = make("gpt2"), [labelled("gpt2", seed) for seed in (1, 2)]
    reference = copy.deepcopy(model)
    split = strategy(model, split_points=["transformer.h.2"], devices=["cpu", "cpu"], chunks=3, sample=data[0])
    opt = torch.optim.SGD(split.parameters(), lr=0.3, momentum=0.9)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.3, momentum=0.9)
    for inputs in data:
        opt.zero_grad()
        ref_opt.zero_grad()
        loss, expected = split(**inputs).loss, reference(**inputs).loss
        assert loss.item() == pytest.approx(expected.item(), abs=1e-6, rel=0)
        loss.backward()
        expected.backward()
        for (n, p), q in zip(split.named_parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, q.grad, atol=1e-9, rtol=0, msg=n)
        opt.step()
        ref_opt.step()
    for (n, p), q in zip(split.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, atol=1e-9, rtol=0, msg=n)
