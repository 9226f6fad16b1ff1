"""ModelParallel/Pipeline over any nn.Module cut as a graph: same numbers as the unsplit model, bad cuts refused.

BatchNorm runs in train mode; with micro-batches the reference is the unsplit model fed the same
micro-batches one after another (BatchNorm normalises each micro-batch by its own statistics), so
outputs and gradients must agree to 1e-5 for every split, chunks and checkpoint mode.
"""
import copy

import pytest
import torch
from torch import nn

import dualframe.torch as hvd
from dualframe.errors import BalanceError, DeviceError, SplitPointError, TraceError
from dualframe.pipeline.microbatch import micro_batch_sizes

MODES = ["never", "except_last", "always"]


class BasicBlock(nn.Module):
    def __init__(self, cin, cout, stride=1):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU()
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        shortcut = x if self.downsample is None else self.downsample(x)
        return self.relu(out + shortcut)


class ResNet(nn.Module):
    def __init__(self, width=4, classes=5):
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU()
        self.layer1 = nn.Sequential(BasicBlock(width, width), BasicBlock(width, width))
        self.layer2 = nn.Sequential(BasicBlock(width, 2 * width, 2), BasicBlock(2 * width, 2 * width))
        self.layer3 = nn.Sequential(BasicBlock(2 * width, 4 * width, 2))
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(4 * width, classes)

    def forward(self, x):
        x = self.relu(self.bn1(self.conv1(x)))
        x = self.layer3(self.layer2(self.layer1(x)))
        return self.fc(torch.flatten(self.pool(x), 1))


class Attention(nn.Module):
    """Self-attention written out, so that a cut can fall inside a block."""

    def __init__(self, dim, heads=2):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x, pad):
        b, t, d = x.shape
        q, k, v = self.qkv(x).reshape(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        scores = (q @ k.transpose(-2, -1)) / (d // self.heads) ** 0.5
        scores = scores.masked_fill(pad[:, None, None, :], float("-inf"))
        out = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, t, d)
        return self.proj(out)


class Block(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.norm1, self.attn = nn.LayerNorm(dim), Attention(dim)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x, pad):
        x = x + self.attn(self.norm1(x), pad)
        return x + self.mlp(self.norm2(x))


class Encoder(nn.Module):
    """Tokens and a padding mask in; (per-token logits, pooled features) out. Every block reads the mask."""

    def __init__(self, own_attention, vocab=11, dim=8, depth=3, length=6):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.position = nn.Parameter(torch.randn(length, dim) * 0.1)
        if own_attention:
            self.blocks = nn.ModuleList(Block(dim) for _ in range(depth))
        else:
            self.blocks = nn.ModuleList(nn.TransformerEncoderLayer(dim, 2, 16, dropout=0.0, batch_first=True)
                                        for _ in range(depth))
        self.own = own_attention
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens, pad):
        h = self.embed(tokens) + self.position
        for block in self.blocks:
            h = block(h, pad) if self.own else block(h, src_key_padding_mask=pad)
        h = self.norm(h)
        keep = (~pad).unsqueeze(-1).to(h.dtype)
        return self.head(h), (h * keep).sum(1) / keep.sum(1)


class DictEncoder(Encoder):
    """The same, taking a dict and returning a dict."""

    def forward(self, batch):
        logits, pooled = super().forward(batch["tokens"], batch["pad"])
        return {"logits": logits, "pooled": pooled}


class Join(nn.Module):
    def forward(self, a, b):
        return a + b


class Skip(nn.Module):
    """The stem's output skips over the middle block to the join."""

    def __init__(self):
        super().__init__()
        self.stem, self.b1, self.b2, self.head = nn.Linear(4, 6), nn.Linear(6, 6), nn.Linear(6, 6), nn.Linear(6, 2)
        self.join = Join()

    def forward(self, x):
        h0 = torch.tanh(self.stem(x))
        h = torch.tanh(self.b2(torch.tanh(self.b1(h0))))
        return self.head(self.join(h, h0))


def tokens(batch, seed=1):
    g = torch.Generator().manual_seed(seed)
    tok = torch.randint(0, 11, (batch, 6), generator=g)
    pad = torch.zeros(batch, 6, dtype=torch.bool)
    pad[:, 4:] = torch.rand(batch, 2, generator=g) > 0.5  # at most the last two padded: no row fully masked
    return tok, pad


def loss_of(out):
    if isinstance(out, dict):
        out = (out["logits"], out["pooled"])
    if isinstance(out, tuple):
        return out[0].pow(2).mean() + out[1].sin().sum()
    return out.pow(2).mean()


def reference_step(model, args, chunks):
    """The unsplit model fed the micro-batches one after another; the same loss on the joined outputs."""
    batch = len(args[0]) if not isinstance(args[0], dict) else len(args[0]["tokens"])
    outs, start = [], 0
    for size in micro_batch_sizes(batch, chunks):
        def cut(v, s=start, e=start + size):
            return {k: t[s:e] for k, t in v.items()} if isinstance(v, dict) else v[s:e]
        outs.append(model(*[cut(a) for a in args]))
        start += size
    if isinstance(outs[0], dict):
        out = {k: torch.cat([o[k] for o in outs]) for k in outs[0]}
    elif isinstance(outs[0], tuple):
        out = tuple(torch.cat(parts) for parts in zip(*outs))
    else:
        out = torch.cat(outs)
    loss_of(out).backward()
    return out


def assert_same(split, reference, args, chunks, grad_args=()):
    out = split(*args)
    loss = loss_of(out)
    loss.backward()
    ref_args = [copy.deepcopy(a) for a in args]
    for k in grad_args:
        ref_args[k] = args[k].detach().clone().requires_grad_()
    ref = reference_step(reference, ref_args, chunks)
    torch.testing.assert_close(loss, loss_of(ref), atol=1e-5, rtol=0)
    flat = lambda o: list(o.values()) if isinstance(o, dict) else (list(o) if isinstance(o, tuple) else [o])  # noqa: E731
    for a, b in zip(flat(out), flat(ref)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    named = dict(reference.named_parameters())
    assert [n for n, _ in split.named_parameters()] == list(named)
    for name, p in split.named_parameters():
        torch.testing.assert_close(p.grad, named[name].grad, atol=1e-5, rtol=0, msg=name)
    for k in grad_args:
        torch.testing.assert_close(args[k].grad, ref_args[k].grad, atol=1e-5, rtol=0)


def make(model_cls, *args, seed=0):
    torch.manual_seed(seed)
    model = model_cls(*args)
    return model, copy.deepcopy(model)


@pytest.mark.parametrize("checkpoint", MODES)
@pytest.mark.parametrize("chunks, batch", [(1, 6), (3, 7), (4, 10)])
@pytest.mark.parametrize("cut", [dict(split_points=["layer2"]), dict(split_points=["layer1.1", "layer3"]),
                                 dict(split_points=["layer2.0.conv2"]), dict(balance=[4, 2, 2])])
def test_resnet_equals_the_unsplit_model(cut, chunks, batch, checkpoint):
    model, reference = make(ResNet)
    n = len(cut.get("split_points", [])) + 1 if "split_points" in cut else len(cut["balance"])
    split = hvd.Pipeline(model, devices=["cpu"] * n, chunks=chunks, checkpoint=checkpoint, **cut)
    x = torch.randn(batch, 3, 8, 8)
    assert_same(split, reference, [x.requires_grad_()], chunks, grad_args=(0,))
    if checkpoint == "never":  # recomputation updates BatchNorm statistics a second time
        for (name, a), b in zip(split.state_dict().items(), reference.state_dict().values()):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=0, msg=name)


def test_resnet_inside_a_block_sends_the_shortcut_input_too():
    split = hvd.ModelParallel(ResNet(), split_points=["layer2.0.conv2"], devices=["cpu", "cpu"])
    crossing = split.graph_stages.split.crossing(0)
    assert len(crossing) == 2  # layer2.0's input (for the downsample shortcut) and bn1->relu's output
    split(torch.randn(2, 3, 8, 8))
    text = split.describe()
    assert "cut at ['layer2.0.conv2']" in text and "[2, 4, 8, 8] float32, 2.0 KiB" in text, text


@pytest.mark.parametrize("own_attention, cut", [
    (False, dict(split_points=["blocks.1", "blocks.2"])),
    (False, dict(balance=[2, 4])),
    (True, dict(split_points=["blocks.0.mlp", "blocks.2.attn"])),
    (True, dict(split_points=["blocks.1.norm2"])),
])
@pytest.mark.parametrize("checkpoint", MODES)
@pytest.mark.parametrize("chunks, batch", [(1, 5), (3, 7), (4, 10)])
def test_transformer_equals_the_unsplit_model(own_attention, cut, checkpoint, chunks, batch):
    model, reference = make(Encoder, own_attention)
    n = len(cut["split_points"]) + 1 if "split_points" in cut else len(cut["balance"])
    split = hvd.Pipeline(model, devices=["cpu"] * n, chunks=chunks, checkpoint=checkpoint, **cut)
    assert_same(split, reference, list(tokens(batch)), chunks)
    for j in range(1, n):  # every stage reads the padding mask straight from the input
        assert "pad" in split.graph_stages.split.reads[j]


@pytest.mark.parametrize("chunks", [1, 3])
def test_dict_in_dict_out(chunks):
    model, reference = make(DictEncoder, True)
    split = hvd.Pipeline(model, split_points=["blocks.1.attn"], devices=["cpu", "cpu"], chunks=chunks)
    tok, pad = tokens(7)
    out = split({"tokens": tok, "pad": pad})
    assert set(out) == {"logits", "pooled"}
    split.zero_grad()
    assert_same(split, reference, [{"tokens": tok, "pad": pad}], chunks)


def test_skip_value_goes_straight_to_the_stage_that_reads_it():
    model, reference = make(Skip)
    split = hvd.Pipeline(model, split_points=["b2", "join"], devices=["cpu"] * 3, chunks=2, checkpoint="always")
    s = split.graph_stages.split
    assert sorted(s.messages(0)) == [("tanh", 2), ("tanh_1", 1)]  # the stem's output skips stage 1
    assert s.reads[1] == ("tanh_1",) and s.reads[2] == ("tanh_2", "tanh")
    assert [n.name for n in split.partitions[1].graph.nodes if n.op == "placeholder"] == ["tanh_1"]
    x = torch.randn(6, 4, requires_grad=True)
    assert_same(split, reference, [x], 2, grad_args=(0,))


def test_state_dict_keeps_the_original_keys_both_ways():
    plain = ResNet()
    split = hvd.ModelParallel(copy.deepcopy(ResNet()), split_points=["layer2"], devices=["cpu", "cpu"])
    assert list(split.state_dict()) == list(plain.state_dict())
    split.load_state_dict(plain.state_dict())
    for a, b in zip(split.state_dict().values(), plain.state_dict().values()):
        assert torch.equal(a, b)
    torch.manual_seed(3)
    other = ResNet()
    other.load_state_dict(split.state_dict())
    assert [n for n, _ in split.named_parameters()] == [n for n, _ in plain.named_parameters()]
    model = Encoder(True)
    split = hvd.ModelParallel(model, stages=2, devices=["cpu", "cpu"])
    assert list(split.state_dict()) == list(Encoder(True).state_dict())  # own parameter "position" first
    assert [id(p) for p in split.parameters()] == [id(p) for p in model.parameters()]


def test_stages_chosen_by_measured_time_and_by_memory():
    class Uneven(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.c = nn.Linear(8, 64), nn.Linear(64, 64), nn.Linear(64, 8)  # least crosses after c
            self.big = nn.Sequential(nn.Linear(8, 512), nn.ReLU(), nn.Linear(512, 512), nn.Linear(512, 8))

        def forward(self, x):
            return self.big(self.c(self.b(self.a(x))))

    model, reference = make(Uneven)
    sample = torch.randn(64, 8)
    split = hvd.Pipeline(model, stages=2, sample=sample, devices=["cpu", "cpu"], chunks=2)
    assert split.split_points == ["big"], split.describe()
    assert "[32, 8] float32" in split.describe() or "[64, 8] float32" in split.describe()
    assert_same(split, reference, [torch.randn(6, 8)], 2)
    by_memory = hvd.ModelParallel(Uneven(), stages=2, sample=sample, by="memory", devices=["cpu", "cpu"])
    assert by_memory.split_points == ["big"]
    assert all(p.grad is None for p in by_memory.parameters())  # measuring leaves nothing behind


class Gate(nn.Module):
    def forward(self, x):
        if x.sum() > 0:  # data-dependent control flow: neither fx nor export can capture it
            return x
        return -x


class ShapeBranch(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.bn = nn.Linear(4, 4), nn.BatchNorm1d(4)

    def forward(self, x):
        if x.shape[-1] == 4:  # static shape: fx cannot trace it, torch.export can
            return torch.relu(self.bn(self.lin(x))) + x
        return x


class Shaped(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.head = ShapeBranch(), ShapeBranch(), nn.Linear(4, 2)

    def forward(self, x):
        return self.head(self.b(self.a(x)))


@pytest.mark.parametrize("checkpoint", MODES)
def test_export_fallback_where_fx_cannot_trace(checkpoint):
    model, reference = make(Shaped)
    split = hvd.Pipeline(model, split_points=["b"], devices=["cpu", "cpu"], chunks=3, checkpoint=checkpoint,
                         sample=torch.randn(6, 4))
    assert split.graph_stages.captured.method == "export"
    assert list(split.state_dict()) == list(reference.state_dict())
    x = torch.randn(7, 4, requires_grad=True)
    assert_same(split, reference, [x], 3, grad_args=(0,))
    if checkpoint == "never":
        torch.testing.assert_close(split.b.bn.running_mean, reference.b.bn.running_mean, atol=1e-6, rtol=0)


def never_ran(model):
    calls = []
    for m in model.modules():
        m.register_forward_hook(lambda m, args, out: calls.extend(a for a in args if isinstance(a, torch.Tensor)))
    return calls


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(split_points=["layer9"]), SplitPointError, r"unknown split point 'layer9'.*did you mean"),
    (dict(split_points=["layer2.0.bn1.weight"]), SplitPointError, r"inside 'layer2.0.bn1', which runs as one piece"),
    (dict(split_points=["layer3", "layer2"]), SplitPointError, r"must follow execution order: 'layer2'"),
    (dict(stages=9, sample=torch.randn(2, 3, 8, 8)), BalanceError, r"more stages than there are places to cut: 8"),
    (dict(balance=[4, 5]), BalanceError, r"balance must sum"),
    (dict(split_points=["layer2"], devices=["cpu"]), DeviceError, r"len\(devices\) = 1"),
    (dict(split_points=["layer2"], balance=[2, 6]), BalanceError, r"exactly one of split_points.*given: split_points, balance"),
])
def test_bad_cuts_refused_before_any_compute(kwargs, error, message):
    model = ResNet()
    calls = never_ran(model)
    kwargs.setdefault("devices", ["cpu"] * (len(kwargs.get("split_points", [])) + 1 if "split_points" in kwargs
                                            else len(kwargs.get("balance", [0] * kwargs.get("stages", 1)))))
    with pytest.raises(error, match=message):
        hvd.Pipeline(model, chunks=2, **kwargs)
    assert not calls


def test_transformer_layer_is_a_leaf_that_cannot_be_cut_inside():
    with pytest.raises(SplitPointError, match=r"'blocks.1.self_attn' .* inside 'blocks.1', which runs as one piece"):
        hvd.ModelParallel(Encoder(False), split_points=["blocks.1.self_attn"], devices=["cpu", "cpu"])


def test_untraceable_model_says_why_and_what_to_do():
    model = nn.Sequential(nn.Linear(4, 4), Gate(), nn.Linear(4, 2))
    with pytest.raises(TraceError, match=r"torch.fx cannot trace Sequential: .*control flow.*\(in 1: Gate.forward.*"
                                         r"Pass sample=.*leaves="):
        hvd.ModelParallel(model, split_points=["2"], devices=["cpu", "cpu"])
    with pytest.raises(TraceError, match=r"cannot be captured as a graph. torch.fx: .* torch.export: .*leaf"):
        hvd.ModelParallel(model, split_points=["2"], devices=["cpu", "cpu"], sample=torch.randn(3, 4))
    split = hvd.ModelParallel(copy.deepcopy(model), split_points=["2"], devices=["cpu", "cpu"], leaves=[Gate])
    x = torch.randn(5, 4)
    torch.testing.assert_close(split(x), model(x), atol=1e-6, rtol=0)


def test_sequential_by_split_points_and_one_layer_refused():
    torch.manual_seed(0)
    seq = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3))
    split = hvd.Pipeline(copy.deepcopy(seq), split_points=["2", "4"], devices=["cpu"] * 3, chunks=2)
    assert split.balance == [2, 2, 1] and list(split.state_dict()) == list(seq.state_dict())
    assert_same(split, seq, [torch.randn(5, 6, requires_grad=True)], 2, grad_args=(0,))
    with pytest.raises(TypeError, match="one torch.nn layer: nothing to split"):
        hvd.ModelParallel(nn.Linear(2, 2), stages=1)


def test_eval_no_grad_and_train_with_an_optimizer():
    model, reference = make(Encoder, True)
    split = hvd.Pipeline(model, split_points=["blocks.1"], devices=["cpu", "cpu"], chunks=2)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (split, reference)]
    for step in range(3):
        tok, pad = tokens(8, seed=step)
        for m, opt in zip((split, reference), optimizers):
            opt.zero_grad()
            loss_of(m(tok, pad)).backward()
            opt.step()
    for a, b in zip(split.parameters(), reference.parameters()):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    split.eval(), reference.eval()
    with torch.no_grad():
        for a, b in zip(split(*tokens(4)), reference(*tokens(4))):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


def test_deferred_batch_norm_in_a_graph_tracks_whole_mini_batch_statistics():
    model, reference = make(ResNet)
    split = hvd.Pipeline(model, split_points=["layer2"], devices=["cpu", "cpu"], chunks=4, checkpoint="always",
                         deferred_batch_norm=True)
    assert isinstance(split.layer2[0].bn1, hvd.DeferredBatchNorm)
    assert list(split.state_dict()) == list(reference.state_dict())
    x = torch.randn(16, 3, 8, 8)
    split(x).sum().backward()
    reference(x).sum().backward()
    # The first BatchNorm sees the same input as the reference's (later ones see micro-batch-normalised input).
    torch.testing.assert_close(split.bn1.running_mean, reference.bn1.running_mean, atol=1e-6, rtol=0)
    torch.testing.assert_close(split.bn1.running_var, reference.bn1.running_var, atol=1e-6, rtol=0)
    tracked = [int(v) for k, v in split.state_dict().items() if k.endswith("num_batches_tracked")]
    assert tracked == [1] * len(tracked)  # once per mini-batch, despite 4 micro-batches and recomputation


class Tied(nn.Module):
    """The output layer reuses the embedding's weight: one parameter read by the first and the last stage."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(11, 8)
        self.body = nn.Sequential(nn.Linear(8, 8), nn.Tanh())
        self.norm = nn.LayerNorm(8)

    def forward(self, tokens):
        h = self.norm(self.body(self.embed(tokens)))
        return h @ self.embed.weight.t()


def test_a_parameter_shared_by_two_stages_gets_both_gradients():
    model, reference = make(Tied)
    split = hvd.Pipeline(model, split_points=["body", "norm"], devices=["cpu"] * 3, chunks=3)
    assert [n for n, _ in split.named_parameters()] == [n for n, _ in reference.named_parameters()]
    assert_same(split, reference, [tokens(7)[0]], 3)


def test_overlap_cpu_and_a_failing_stage_in_a_graph():
    from dualframe.errors import StageError

    model, reference = make(Encoder, True)
    split = hvd.Pipeline(model, split_points=["blocks.1"], devices=["cpu", "cpu"], chunks=3, overlap_cpu=True)
    with split.record() as timeline:
        assert_same(split, reference, list(tokens(7)), 3)
    assert sorted((e.kind, e.micro_batch, e.stage) for e in timeline.events) == sorted(
        (k, i, j) for k in "FB" for i in range(3) for j in range(2))
    tok, pad = tokens(6)
    with pytest.raises(StageError, match=r"stage 0 failed on micro-batch 0"):
        split(tok + 100, pad)  # an index out of the embedding's range


def test_schedule_is_checked_for_graphs_too():
    from dualframe.errors import ScheduleError

    with pytest.raises(ScheduleError, match="1f1b"):
        hvd.Pipeline(ResNet(), split_points=["layer2"], devices=["cpu", "cpu"], chunks=2, schedule="1f1b")
    assert hvd.Pipeline(ResNet(), split_points=["layer2"], devices=["cpu", "cpu"], chunks=2).schedule == "gpipe"


class FunctionalDropout(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 8), nn.Linear(8, 2)

    def forward(self, x):
        return self.b(nn.functional.dropout(torch.relu(self.a(x)), 0.5, training=self.training))


@pytest.mark.parametrize("model_cls, kwargs", [(FunctionalDropout, {}), (Shaped, dict(sample=torch.randn(6, 4)))])
def test_mode_recorded_by_the_capture_follows_train_and_eval(model_cls, kwargs):
    # fx records F.dropout's training flag, torch.export every BatchNorm's: the other mode is captured too.
    model, reference = make(model_cls)
    split = hvd.Pipeline(model, split_points=["b"], devices=["cpu", "cpu"], chunks=2, **kwargs)
    x = torch.randn(6, 4)
    split.eval(), reference.eval()
    with torch.no_grad():
        evaluated = split(x)
        torch.testing.assert_close(evaluated, reference(x), atol=1e-6, rtol=0)
    split.train(), reference.train()
    if model_cls is FunctionalDropout:
        assert not torch.allclose(split(x), evaluated)  # dropout is on again
    else:
        assert_same(split, reference, [x], 2)


class _Positions(nn.Module):
    """Position ids made on the input's device, as GPT-2 makes them: capture records that device."""

    def __init__(self):
        super().__init__()
        self.table = nn.Embedding(8, 3)

    def forward(self, x):
        return x + self.table(torch.arange(x.shape[1], device=x.device)).sum(-1)


def test_a_stage_placed_on_another_device_makes_its_recorded_constants_there():
    from dualframe.torch.graph.devices import place_stage

    gm = torch.export.export(_Positions(), (torch.zeros(2, 5),)).module()
    assert any(n.kwargs.get("device") == torch.device("cpu") for n in gm.graph.nodes)
    place_stage(gm, torch.device("meta"))  # another device than the capture's, present without a GPU
    assert {n.kwargs["device"] for n in gm.graph.nodes if "device" in n.kwargs} == {torch.device("meta")}
    assert gm(torch.zeros(2, 5, device="meta")).device.type == "meta"
