"""ZeRO-3 (shard="parameters") on 2 ranks: weights equal plain data parallelism, 1/N of the bytes, checkpoints, mixed precision, refusals.

Every rank runs every test. Each compares with plain data parallelism on the same data (or with a
one-process reference inside the rank); ``model_state_dict()`` is the unsharded weights. The mixed
precision tests reuse mp_torch_shard_amp's MLP, data and fp32-master reference (ZeRO-1/2's twins).
"""
import pytest
import torch
import torch.nn as nn

import dualframe
import dualframe.torch as hvd
import dualframe.torch.dp.shard.blocks as shard_blocks
from mp_torch_shard_amp import adam, sgd
from mp_torch_shard_amp import batches as mlp_batches, loss as amp_loss, make as mlp, reference as master_reference

TOL = 1e-5
SINGLES = [hvd.ProcessSet([0]), hvd.ProcessSet([1])]


@pytest.fixture(scope="module", autouse=True)
def started():
    hvd.init(process_sets=SINGLES)
    assert hvd.size() == 2


class ResBlock(nn.Module):
    def __init__(self, channels):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(channels, channels, 3, padding=1), nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, x):
        return torch.relu(x + self.conv2(torch.relu(self.bn1(self.conv1(x)))))


def residual_net(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), ResBlock(8), ResBlock(8), nn.AdaptiveAvgPool2d(1),
                         nn.Flatten(), nn.Linear(8, 3))


class TinyTransformer(nn.Module):
    """Embeddings, two encoder layers (their attention reads out_proj's weight directly), a root parameter, a head."""

    def __init__(self, vocab=11, width=16, length=5):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.position = nn.Parameter(0.1 * torch.randn(length, width))
        self.layers = nn.ModuleList([nn.TransformerEncoderLayer(width, 2, 32, dropout=0.0, batch_first=True)
                                     for _ in range(2)])
        self.norm, self.head = nn.LayerNorm(width), nn.Linear(width, 3)

    def forward(self, tokens):
        h = self.embed(tokens) + self.position
        for layer in self.layers:
            h = layer(h)
        return self.head(self.norm(h).mean(dim=1))


def transformer(seed=0):
    torch.manual_seed(seed)
    return TinyTransformer()


def data(kind, steps=3, rows=8, seed=1):
    g = torch.Generator().manual_seed(seed)
    make = ((lambda: torch.randn(rows, 3, 6, 6, generator=g)) if kind == "residual"
            else (lambda: torch.randint(0, 11, (rows, 5), generator=g)))
    return [(make(), torch.randn(rows, 3, generator=g)) for _ in range(steps)]


MODELS = {"residual": residual_net, "transformer": transformer}
# Attention's key bias has a gradient of zero but for rounding; Adam's default eps=1e-8 would turn a
# 1e-9 rounding difference (another summation order) into a full learning-rate step: eps=1e-4 does not.
OPTIMIZERS = {"sgd": lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9),
              "adam": lambda m: torch.optim.Adam(m.parameters(), lr=0.01, eps=1e-4)}


def train(model, optimizer, batches, passes=1):
    for x, y in batches:
        optimizer.zero_grad()
        xs, ys = hvd.shard_batch(x), hvd.shard_batch(y)
        for part in range(passes):  # each pass a 1/passes part of the rank's rows
            rows = slice(part * len(xs) // passes, (part + 1) * len(xs) // passes)
            (((model(xs[rows]) - ys[rows]) ** 2).mean() / passes).backward()
        optimizer.step()


def plain(kind, name, batches, passes=1):
    model = MODELS[kind]()
    optimizer = hvd.DistributedOptimizer(OPTIMIZERS[name](model), model.named_parameters(),
                                         backward_passes_per_step=passes)
    train(model, optimizer, batches, passes)
    return model


def assert_same_weights(full, model):
    expected = model.state_dict()
    assert sorted(full) == sorted(expected)
    for key, value in expected.items():
        assert torch.allclose(full[key].float(), value.float(), atol=TOL), (key, (full[key] - value).abs().max())


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("kind", sorted(MODELS))
def test_weights_equal_plain_data_parallel(kind, name):
    batches = data(kind)
    model = MODELS[kind](hvd.rank())  # distribute starts every rank from rank 0's weights
    model, optimizer = hvd.distribute(model, OPTIMIZERS[name](model), dualframe.DataParallel(shard="parameters"))
    assert optimizer.shard == "parameters" and len(optimizer._blocks) >= 4
    train(model, optimizer, batches)
    assert_same_weights(optimizer.model_state_dict(), plain(kind, name, batches))


def test_backward_passes_per_step_equals_plain():
    batches = data("transformer")
    model = transformer()
    optimizer = hvd.DistributedOptimizer(OPTIMIZERS["adam"](model), model.named_parameters(), shard="parameters",
                                         model=model, backward_passes_per_step=2)
    train(model, optimizer, batches, passes=2)
    assert_same_weights(optimizer.model_state_dict(), plain("transformer", "adam", batches, passes=2))


@pytest.mark.parametrize("keep", [0, 2, 99])
def test_keep_gathered_saves_the_backward_gathers_and_equals_plain(keep, monkeypatch):
    batches = data("transformer")
    model = transformer()
    optimizer = hvd.DistributedOptimizer(OPTIMIZERS["sgd"](model), model.named_parameters(), shard="parameters",
                                         model=model, keep_gathered=keep)
    gathers, allgather_into = [], shard_blocks.allgather_into
    monkeypatch.setattr(shard_blocks, "allgather_into", lambda *args: gathers.append(1) or allgather_into(*args))
    train(model, optimizer, batches)
    monkeypatch.undo()
    blocks = len(optimizer._slots)  # one slot (bucket) per block here: all float32, one param group
    assert blocks == len(optimizer._blocks) == 6
    # The first step gathers every block twice (the order is being learnt); then the last `keep` once.
    assert len(gathers) == 2 * blocks * len(batches) - min(keep, blocks) * (len(batches) - 1)
    assert_same_weights(optimizer.model_state_dict(), plain("transformer", "sgd", batches))


def state_bytes(optimizer):
    return sum(v.numel() * v.element_size() for s in optimizer.state.values() for v in s.values()
               if isinstance(v, torch.Tensor) and v.dim() > 0)


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_bytes_per_rank_are_half_of_plain(kind):
    batches = data(kind, steps=1)
    reference = MODELS[kind]()
    ref_optimizer = hvd.DistributedOptimizer(OPTIMIZERS["adam"](reference), reference.named_parameters())
    train(reference, ref_optimizer, batches)
    plain_bytes = sum(2 * p.numel() * p.element_size() for p in reference.parameters()) + state_bytes(ref_optimizer)
    model = MODELS[kind]()
    optimizer = hvd.DistributedOptimizer(OPTIMIZERS["adam"](model), model.named_parameters(), shard="parameters",
                                         model=model)
    gathered = []  # bytes of full parameters present as each block starts its forward
    hooks = [block.module.register_forward_pre_hook(
        lambda *_: gathered.append(sum(s.buffer.untyped_storage().nbytes() for b in optimizer._blocks
                                       for s in b.slots))) for block in optimizer._blocks]
    train(model, optimizer, batches)
    for hook in hooks:
        hook.remove()
    slices = sum(2 * s.flat.numel() * s.flat.element_size() for s in optimizer._slots)  # slice + its gradient
    mine = sum(p.untyped_storage().nbytes() for p in model.parameters()) + slices + state_bytes(optimizer)
    largest = max(sum(s.buffer.numel() * s.buffer.element_size() for s in b.slots) for b in optimizer._blocks)
    assert all(p.grad is None for p in model.parameters())
    assert abs(mine - plain_bytes / 2) <= largest, (mine, plain_bytes)
    # Forward holds the running block and the root's (the prefetched one is in Horovod's output): not the model.
    assert max(gathered) <= 2 * largest and max(gathered) < plain_bytes / 4, (gathered, largest)


def test_checkpoint_saved_at_two_ranks_loads_plainly_and_resumes_on_one(tmp_path_factory):
    batches = data("transformer", steps=3)
    model = transformer()
    optimizer = hvd.DistributedOptimizer(OPTIMIZERS["adam"](model), model.named_parameters(), shard="parameters",
                                         model=model)
    train(model, optimizer, batches[:2])
    weights, state = optimizer.model_state_dict(), optimizer.state_dict()
    with pytest.raises(dualframe.StrategyError, match=r"call optimizer\.model_state_dict\(\) on every rank"):
        model.state_dict()
    path = tmp_path_factory.mktemp(f"rank{hvd.rank()}") / "zero3.pt"
    torch.save(weights, path)
    loaded = transformer(5)
    loaded.load_state_dict(torch.load(path))  # a plain model, no dualframe
    reference = plain("transformer", "adam", batches[:2])
    assert_same_weights(loaded.state_dict(), reference)
    # Resume on one rank (each rank its own set of one) with the whole batch: as plain DP's third step.
    alone = transformer(7)
    resumed = hvd.DistributedOptimizer(OPTIMIZERS["adam"](alone), alone.named_parameters(), shard="parameters",
                                       model=alone, process_set=SINGLES[hvd.rank()])
    resumed.load_model_state_dict(torch.load(path))
    resumed.load_state_dict(state)
    x, y = batches[2]
    resumed.zero_grad()
    ((alone(x) - y) ** 2).mean().backward()
    resumed.step()
    train(model, optimizer, batches[2:])
    assert_same_weights(resumed.model_state_dict(), plain("transformer", "adam", batches))
    assert_same_weights(optimizer.model_state_dict(), plain("transformer", "adam", batches))


def test_checkpoint_saved_on_one_rank_resumes_on_two():
    batches = data("transformer", steps=3)
    alone = transformer()  # each rank its own one-rank run on the whole batch: the same checkpoint on both
    single = hvd.DistributedOptimizer(OPTIMIZERS["adam"](alone), alone.named_parameters(), shard="parameters",
                                      model=alone, process_set=SINGLES[hvd.rank()])
    for x, y in batches[:2]:
        single.zero_grad()
        ((alone(x) - y) ** 2).mean().backward()
        single.step()
    weights, state = single.model_state_dict(), single.state_dict()
    model = transformer(3)
    optimizer = hvd.DistributedOptimizer(OPTIMIZERS["adam"](model), model.named_parameters(), shard="parameters",
                                         model=model)
    optimizer.load_model_state_dict(weights)
    optimizer.load_state_dict(state)
    train(model, optimizer, batches[2:])
    assert_same_weights(optimizer.model_state_dict(), plain("transformer", "adam", batches))


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.head = nn.Embedding(5, 4), nn.Linear(4, 5, bias=False)
        self.head.weight = self.embed.weight


@pytest.mark.parametrize("build, message", [
    (lambda m: hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), m.named_parameters(),
                                        shard="parameters"), r"needs the model"),
    (lambda m: hvd.DistributedOptimizer(torch.optim.LBFGS(m.parameters()), m.named_parameters(), shard="parameters",
                                        model=m), r"element-wise optimizer"),
    (lambda m: hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), m.named_parameters(),
                                        shard="gradients", model=m), r"model= is for shard='parameters'"),
    (lambda m: hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), m.named_parameters(),
                                        shard="parameters", model=m, keep_gathered=-1), r"keep_gathered must be"),
    (lambda m: hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), m.named_parameters(),
                                        shard="gradients", keep_gathered=2), r"keep_gathered= is for shard='param"),
    (lambda m: hvd.DistributedOptimizer(torch.optim.SGD(Tied().parameters(), lr=0.1), shard="parameters",
                                        model=Tied()), r"embed.weight is also head.weight"),
    (lambda m: hvd.DistributedOptimizer(torch.optim.SGD(residual_net().parameters(), lr=0.1), shard="parameters",
                                        model=m), r"holds one that is not in the model"),
])
def test_refused_before_any_communication(build, message):
    # One rank refusing alone would leave the other in a collective: every case raises on every rank.
    with pytest.raises(dualframe.StrategyError, match=message):
        build(transformer())


# -- mixed precision: autocast on fp32 weights, float16/bfloat16 weights through fp32 master slices --------
def zero3_mixed(dtype, autocast, make_optimizer, scale):
    """ZeRO-3 on the MLP of mp_torch_shard_amp with hvd.ShardedGradScaler (disabled at scale 1)."""
    model = mlp(dtype)
    optimizer = hvd.DistributedOptimizer(make_optimizer(model.parameters()), model.named_parameters(),
                                         shard="parameters", model=model)
    scaler = hvd.ShardedGradScaler("cpu", init_scale=scale, enabled=scale != 1.0)
    scaled_steps(model, optimizer, scaler, mlp_batches(), autocast)
    return optimizer, scaler.get_scale()


def scaled_steps(model, optimizer, scaler, batches, autocast=None):
    for x, y in batches:
        optimizer.zero_grad()
        scaler.scale(amp_loss(model, hvd.shard_batch(x), hvd.shard_batch(y), autocast)).backward()
        scaler.step(optimizer)
        scaler.update()


def autocast_reference(autocast, make_optimizer, scale):
    """One process, plain torch: autocast and torch.amp.GradScaler, the loss the mean of the two ranks' halves."""
    model = mlp()
    optimizer = make_optimizer(model.parameters())
    scaler = torch.amp.GradScaler("cpu", init_scale=scale, enabled=scale != 1.0)
    for x, y in mlp_batches():
        optimizer.zero_grad()
        halves = [amp_loss(model, x[4 * r:4 * r + 4], y[4 * r:4 * r + 4], autocast) for r in range(2)]
        scaler.scale((halves[0] + halves[1]) / 2).backward()
        scaler.step(optimizer)
        scaler.update()
    return model, scaler.get_scale()


@pytest.mark.parametrize("autocast, make_optimizer, scale", [(torch.bfloat16, adam, 1.0), (torch.float16, sgd, 1024.0),
                                                             (torch.float16, adam, 1024.0)])
def test_autocast_equals_one_process_torch_autocast_and_grad_scaler(autocast, make_optimizer, scale):
    optimizer, got_scale = zero3_mixed(torch.float32, autocast, make_optimizer, scale)
    expected, expected_scale = autocast_reference(autocast, make_optimizer, scale)
    assert got_scale == expected_scale == scale
    assert_same_weights(optimizer.model_state_dict(), expected)


@pytest.mark.parametrize("dtype, make_optimizer, scale, tol", [(torch.bfloat16, adam, 1.0, TOL),
                                                                (torch.float16, sgd, 256.0, 1e-3)])
def test_low_precision_weights_step_through_fp32_master_slices(dtype, make_optimizer, scale, tol):
    optimizer, _ = zero3_mixed(dtype, None, make_optimizer, scale)
    expected, _ = master_reference(dtype, make_optimizer, scale)
    full = optimizer.model_state_dict()
    assert all(v.dtype == dtype for v in full.values())
    assert all(s.flat.dtype == torch.float32 and s.flat.numel() == s.bucket.shard for s in optimizer._slots)
    for key, value in expected.state_dict().items():
        assert torch.allclose(full[key].float(), value.float(), atol=tol), (key, (full[key] - value).abs().max())


def test_inf_in_one_ranks_slice_skips_the_step_on_every_rank():
    model = mlp(torch.float16)
    optimizer = hvd.DistributedOptimizer(adam(model.parameters()), model.named_parameters(), shard="parameters",
                                         model=model)
    scaler = hvd.ShardedGradScaler("cpu", init_scale=256.0, growth_interval=2)
    (x, y), before = mlp_batches()[0], optimizer.model_state_dict()
    scaler.scale(amp_loss(model, hvd.shard_batch(x), hvd.shard_batch(y))).backward()
    slices = optimizer.reduced_slices()
    if hvd.rank() == 1:
        slices[-1][0] = float("inf")  # in rank 1's slice only: rank 0's reduced gradients are all finite
    scaler.step(optimizer)
    scaler.update()
    assert hvd.allgather(torch.tensor([scaler.get_scale()]), name="zero3.amp.scale").tolist() == [128.0, 128.0]
    assert_same_weights(optimizer.model_state_dict(), _Loaded(before))
    assert all(len(s) == 0 for s in optimizer.state.values())  # no Adam step taken
    scaled_steps(model, optimizer, scaler, mlp_batches(2)[:2])  # growth_interval good steps: the scale grows back
    assert scaler.get_scale() == 256.0
    assert not torch.equal(optimizer.model_state_dict()["0.weight"], before["0.weight"])


class _Loaded:
    """A state dict seen as a model (for assert_same_weights)."""

    def __init__(self, state):
        self.state = state

    def state_dict(self):
        return self.state
