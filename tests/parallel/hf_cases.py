"""Hugging Face ``transformers`` models from small configs (nothing downloaded), their batches, a loss, a reference.

Shared by tests/torch/test_hf_split.py (one process) and tests/parallel/mp_torch_hf.py (2 processes);
not a worker (its name does not start with ``mp_``). Every model is float64 with dropout off, so a
split must equal the unsplit model to 1e-9. GPT-2 is built with ``tie_word_embeddings=False``: its head
then has its own weight (a weight tied across stages is another change's).
"""
import copy

import torch
import transformers
from torch import nn

transformers.logging.set_verbosity_error()  # small vocabularies: the configs' token-id warnings

VOCAB, LENGTH, BATCH = 96, 8, 6


def _small(**kwargs):
    return dict(vocab_size=VOCAB, hidden_size=16, num_attention_heads=2, intermediate_size=32, **kwargs)


def gpt2():
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=32, n_embd=16, n_layer=4, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, use_cache=False, tie_word_embeddings=False))


def bert():
    return transformers.BertForMaskedLM(transformers.BertConfig(
        **_small(num_hidden_layers=4), max_position_embeddings=32, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, tie_word_embeddings=False))


def llama():
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        **_small(num_hidden_layers=4, num_key_value_heads=1), max_position_embeddings=32, use_cache=False,
        tie_word_embeddings=False))


def moe():
    return transformers.MixtralForCausalLM(transformers.MixtralConfig(
        **_small(num_hidden_layers=3, num_key_value_heads=1), num_local_experts=4, num_experts_per_tok=2,
        max_position_embeddings=32, use_cache=False, tie_word_embeddings=False, router_jitter_noise=0.0,
        experts_implementation="batched_mm"))  # grouped_mm takes no float64; eager loops on data


def t5():
    model = transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=VOCAB, d_model=16, d_kv=8, d_ff=32, num_layers=2, num_decoder_layers=2, num_heads=2,
        dropout_rate=0.0, use_cache=False, tie_word_embeddings=False, decoder_start_token_id=0))
    model.lm_head.weight = nn.Parameter(model.lm_head.weight.detach().clone())  # transformers 5 ties it anyway
    return model


#: name: (builder, a cut inside the block stack, a cut at the head)
MODELS = {
    "gpt2": (gpt2, "transformer.h.2", "lm_head"),
    "bert": (bert, "bert.encoder.layer.2", "cls"),
    "llama": (llama, "model.layers.2", "lm_head"),
    "moe": (moe, "model.layers.1", "lm_head"),
    "t5": (t5, "decoder.block.0", "lm_head"),
}


def make(name, seed=0):
    torch.manual_seed(seed)
    return MODELS[name][0]().double().train()


def batch(name, seed=1, rows=BATCH):
    """Keyword inputs for ``name`` (a padded attention mask for BERT and T5) and token targets."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (rows, LENGTH), generator=g)
    inputs = {"input_ids": ids}
    if name in ("bert", "t5"):
        mask = torch.ones(rows, LENGTH, dtype=torch.long)
        mask[::2, LENGTH - 3:] = 0  # every other row padded
        inputs["attention_mask"] = mask
    if name == "t5":
        inputs["decoder_input_ids"] = torch.randint(1, VOCAB, (rows, LENGTH - 2), generator=g)
    rows_out = inputs.get("decoder_input_ids", ids)
    return inputs, torch.randint(0, VOCAB, rows_out.shape, generator=g)


def labelled(name, seed=1):
    """``batch(name)``'s inputs with its targets among them as ``labels=`` (the model then returns its loss)."""
    inputs, target = batch(name, seed)
    return {**inputs, "labels": target}


def loss_fn(output, target):
    """Mean cross-entropy of every position's logits (the model's output object, or its dict form)."""
    logits = output["logits"] if isinstance(output, dict) else output.logits
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def reference_grads(model, inputs, target):
    """The unsplit model's loss and every parameter's gradient, by name (on a copy)."""
    model = copy.deepcopy(model)
    loss = loss_fn(model(**inputs), target)
    loss.backward()
    return loss.item(), {n: p.grad for n, p in model.named_parameters()}
