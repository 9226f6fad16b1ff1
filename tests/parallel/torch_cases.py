"""Models, data and one-process references that the torch worker files share (tests/parallel, tests/cluster).

Not a worker itself (its name does not start with ``mp_``, so test_launchers.py does not launch it).
Files in tests/parallel import it by its bare name (pytest puts their folder on sys.path); files
elsewhere as ``tests.parallel.torch_cases`` (every launch sets PYTHONPATH to the repository root).
"""
import copy

import horovod.torch as horovod
import pytest
import torch
from torch import nn

import dualframe.torch as hvd


class Residual(nn.Module):
    """A small residual net with a LayerNorm: several tensors of several shapes per sharded-optimizer bucket."""

    def __init__(self):
        super().__init__()
        self.inp, self.block, self.norm, self.out = nn.Linear(6, 8), nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 3)

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        return self.out(self.norm(h + torch.tanh(self.block(h))))


def make_residual(seed):
    torch.manual_seed(seed)
    return Residual()


def small_data_parallel(lr):
    """A 4-8-1 MLP (seed 0) under a DistributedOptimizer(SGD(lr)), rank 0's weights broadcast: the fault workers' job."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=lr),
                                         named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    return model, optimizer


# --- The two-stage pipeline of the DistributedPipeline workers: balance [3, 2] of this model ----------------------
def pipeline_model():
    torch.manual_seed(7)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 3))


def pipeline_batches(rows, steps=4):
    generator = torch.Generator().manual_seed(11)
    return [(torch.randn(rows, 6, generator=generator), torch.randn(rows, 3, generator=generator))
            for _ in range(steps)]


def pipeline_reference(model, data):
    """One process trains (a copy of) the whole model on the same batches: losses and final state_dict."""
    model = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for x, y in data:
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, model.state_dict()


def merged_state_dict(pipe):
    """A DistributedPipeline's whole state_dict on every rank: each rank's part, gathered and joined."""
    merged = {}
    for part in horovod.allgather_object(pipe.state_dict()):
        merged.update(part)
    return merged


def check_pipeline_training(pipe, data, expected, atol=1e-5):
    """Train ``pipe`` as ``pipeline_reference`` trains (SGD, lr 0.1, momentum 0.9) on ``data``, inputs given to the
    first stage and targets to the last only: each step's loss and the merged weights must equal ``expected``
    (``pipeline_reference``'s losses and state_dict)."""
    expected_losses, expected_state = expected
    optimizer = torch.optim.SGD(pipe.parameters(), lr=0.1, momentum=0.9)
    for step, (x, y) in enumerate(data):
        optimizer.zero_grad()
        loss = pipe.train_step(x if pipe.is_first else None, y if pipe.is_last else None)
        assert loss == pytest.approx(expected_losses[step], abs=atol), f"step {step}"
        optimizer.step()
    merged = merged_state_dict(pipe)
    assert sorted(merged) == sorted(expected_state)
    for key, value in expected_state.items():
        torch.testing.assert_close(merged[key], value, atol=atol, rtol=0, msg=key)


# -- tied weights (mp_torch_tied.py, tests/torch/test_tied_torch.py) -------------------------------------
TIED_VOCAB = 40


class SharedEnds(nn.Module):
    """Its first and last layers are one weight (6 x 6), read by the first and the last stage."""

    def __init__(self):
        super().__init__()
        self.first, self.mid, self.last = nn.Linear(6, 6), nn.Linear(6, 6), nn.Linear(6, 6)
        self.last.weight = self.first.weight

    def forward(self, x):
        return self.last(torch.tanh(self.mid(torch.tanh(self.first(x)))))


class SharedLayer(nn.Module):
    """One layer (``shared``) called twice, once in each half: cut at ``mid``, both stages read its weight and bias."""

    def __init__(self):
        super().__init__()
        self.inp, self.shared, self.mid = nn.Linear(6, 6), nn.Linear(6, 6), nn.Linear(6, 6)

    def forward(self, x):
        h = torch.tanh(self.shared(torch.tanh(self.inp(x))))
        return self.shared(torch.tanh(self.mid(h)))


def shared_layer():
    torch.manual_seed(4)
    return SharedLayer().double()


def shared_ends(sequential=False):
    """``SharedEnds`` in float64 (seed 3), or its layers as an ``nn.Sequential`` (first ... last)."""
    torch.manual_seed(3)
    model = SharedEnds().double()
    if sequential:
        return nn.Sequential(model.first, nn.Tanh(), model.mid, nn.Tanh(), model.last)
    return model


def tied_gpt2(layers=2):
    """A tiny GPT-2 (transformers) in float64 with its head tied to the token embedding, dropout off."""
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=TIED_VOCAB, n_positions=16, n_embd=8, n_layer=layers, n_head=2,
                                     use_cache=False, bos_token_id=0, eos_token_id=0,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).double()
    assert model.lm_head.weight is model.transformer.wte.weight
    return model


def lm_loss(output, target):
    """Next-token cross entropy of a causal LM's output (a ModelOutput or its dict) against token ids."""
    logits = output["logits"] if isinstance(output, dict) else output.logits
    return nn.functional.cross_entropy(logits.reshape(-1, TIED_VOCAB), target.reshape(-1))


def token_batches(steps=2, rows=4, length=6):
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, TIED_VOCAB, (rows, length), generator=g),
             torch.randint(0, TIED_VOCAB, (rows, length), generator=g)) for _ in range(steps)]


def float_batches(steps=2, rows=4):
    g = torch.Generator().manual_seed(2)
    return [(torch.randn(rows, 6, generator=g, dtype=torch.float64),
             torch.randn(rows, 6, generator=g, dtype=torch.float64)) for _ in range(steps)]
