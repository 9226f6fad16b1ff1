"""PyTorch data parallelism on 2 ranks equals one process training rank 0's model on the global batch.

Every rank runs every test. The one-process reference is computed inside each rank: the same
initial model (seed 0, which rank 0 holds and broadcasts), trained on the whole global batch.
"""
import os

import pytest
import torch
import torch.nn as nn

import dualframe
import dualframe.torch as hvd
import dualframe.torch.dp.shard.optimizer as shard_module
from dualframe.errors import NotInitializedError, StrategyError
from torch_cases import make_residual  # tests/parallel is on sys.path (pytest rootdir import)

LAUNCHER = os.environ.get("DUALFRAME_TEST_LAUNCHER", "")
TOL = 1e-5
STEPS, BATCH = 4, 8  # global batch of 8 rows, 4 rows per rank
SINGLETONS = [hvd.ProcessSet([0]), hvd.ProcessSet([1])]


def test_before_init_every_call_is_refused():
    assert not hvd.is_initialized()
    model = nn.Linear(2, 1)
    for call in (hvd.rank, hvd.size, hvd.local_rank, hvd.barrier, lambda: hvd.allreduce(torch.ones(1)),
                 lambda: hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1)),
                 lambda: hvd.broadcast_parameters(model.state_dict(), root_rank=0)):
        with pytest.raises(NotInitializedError, match="init"):
            call()
    with pytest.raises(StrategyError, match=r"process_sets\[0\] must list distinct ranks in \[0, 2\) \(ranks: \[0, 5\]"):
        hvd.init(process_sets=[[0, 5]])
    assert not hvd.is_initialized()
    hvd.init(process_sets=SINGLETONS)
    assert hvd.size() == 2 and hvd.local_size() == 2 and hvd.cross_size() == 1


def test_process_set_limits_the_reduction():
    """Each rank reduces over its own one-rank process set: that is local training on its own shard."""
    data = batches(2)
    mine = SINGLETONS[hvd.rank()]
    model, optimizer = start_distributed(sgd, process_set=mine)
    train_distributed(model, optimizer, data)
    reference = make_model(0)
    optimizer_ref = sgd(reference)
    for x, y in data:
        optimizer_ref.zero_grad()
        mse(reference, hvd.shard_batch(x), hvd.shard_batch(y)).backward()
        optimizer_ref.step()
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.allclose(p, q, atol=TOL)


def make_model(seed, batch_norm=None):
    torch.manual_seed(seed)
    layers = [nn.Linear(6, 8)] + ([batch_norm(8)] if batch_norm else []) + [nn.Tanh(), nn.Linear(8, 3)]
    return nn.Sequential(*layers)


def batches(steps=STEPS, seed=123):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(BATCH, 6, generator=g), torch.randn(BATCH, 3, generator=g)) for _ in range(steps)]


def mse(model, x, y):
    return ((model(x) - y) ** 2).mean()


def start_distributed(make_optimizer, batch_norm=None, build=None, **wrap):
    """Rank r builds a different model (seed r); broadcasting rank 0's makes them equal."""
    model = build(hvd.rank()) if build else make_model(hvd.rank(), batch_norm)
    optimizer = hvd.DistributedOptimizer(make_optimizer(model), named_parameters=model.named_parameters(), **wrap)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    return model, optimizer


def train_reference(make_optimizer, data, loss_scale=1.0, batch_norm=None):
    model = make_model(0, batch_norm)
    optimizer = make_optimizer(model)
    for x, y in data:
        optimizer.zero_grad()
        (mse(model, x, y) * loss_scale).backward()
        optimizer.step()
    return model


def assert_same_everywhere(model, reference, tol=TOL):
    for (name, value), expected in zip(model.state_dict().items(), reference.state_dict().values()):
        gathered = hvd.allgather(value.detach().float().unsqueeze(0), name=f"check.{name}")
        assert torch.equal(gathered[0], gathered[1]), f"{name} differs between ranks"
        assert torch.allclose(value.float(), expected.float(), atol=tol, rtol=tol), (
            f"{name} off the one-process reference by {(value.float() - expected.float()).abs().max():.3g}")


def train_distributed(model, optimizer, data, passes=1, scheduler=None):
    for x, y in data:
        optimizer.zero_grad()
        x_local, y_local = hvd.shard_batch(x), hvd.shard_batch(y)
        for xp, yp in zip(x_local.chunk(passes), y_local.chunk(passes)):
            (mse(model, xp, yp) / passes).backward()
        optimizer.step()
        if scheduler is not None:
            scheduler.step()


def sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


@pytest.mark.parametrize("wrap", [{}, {"groups": 2}, {"gradient_predivide_factor": 2.0}],
                         ids=["per-tensor", "groups", "predivide"])
def test_sgd_momentum_matches_one_process(wrap):
    data = batches()
    model, optimizer = start_distributed(sgd, **wrap)
    train_distributed(model, optimizer, data)
    assert_same_everywhere(model, train_reference(sgd, data))


def test_an_optimizer_wrapped_twice_is_reduced_once_by_its_newest_wrapper():
    """Horovod allows wrapping one optimizer again (a script rebuilding its wrapper); the old one stays alive here."""
    data = batches()
    model, first = start_distributed(sgd, op=hvd.Sum)  # were its hooks still live, the sums would double
    second = hvd.DistributedOptimizer(first.optimizer, named_parameters=model.named_parameters())
    assert isinstance(second, torch.optim.SGD) and isinstance(first, torch.optim.SGD)
    train_distributed(model, second, data)
    assert_same_everywhere(model, train_reference(sgd, data))


def test_synchronize_then_clip_then_skip_synchronize():
    """Horovod's gradient-clipping pattern: clip the averaged gradients, then step without reducing again."""
    data = batches()
    model, optimizer = start_distributed(sgd)
    for x, y in data:
        optimizer.zero_grad()
        mse(model, hvd.shard_batch(x), hvd.shard_batch(y)).backward()
        optimizer.synchronize()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        with optimizer.skip_synchronize():
            optimizer.step()
    reference = make_model(0)
    optimizer_ref = sgd(reference)
    for x, y in data:
        optimizer_ref.zero_grad()
        mse(reference, x, y).backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.05)
        optimizer_ref.step()
    assert_same_everywhere(model, reference)


def test_adam_with_broadcast_optimizer_state():
    adam = lambda m: torch.optim.Adam(m.parameters(), lr=0.01)  # noqa: E731
    model = make_model(hvd.rank())
    local = adam(model)
    mse(model, *batches(1, seed=hvd.rank())[0]).backward()
    local.step()  # each rank's Adam state now differs; rank 0's is the one to keep (as after a resume)
    optimizer = hvd.DistributedOptimizer(local, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    state = optimizer.state_dict()["state"][0]["exp_avg"]
    gathered = hvd.allgather(state.unsqueeze(0), name="adam.state")
    assert torch.equal(gathered[0], gathered[1])
    data = batches()
    train_distributed(model, optimizer, data)
    assert_same_everywhere(model, train_reference(adam, batches(1, seed=0) + data))


def test_backward_passes_per_step_two_half_batches():
    data = batches()
    model, optimizer = start_distributed(sgd, backward_passes_per_step=2)
    train_distributed(model, optimizer, data, passes=2)
    assert_same_everywhere(model, train_reference(sgd, data))


def test_op_sum_is_size_times_the_gradient():
    data = batches()
    model, optimizer = start_distributed(sgd, op=hvd.Sum)
    train_distributed(model, optimizer, data)
    assert_same_everywhere(model, train_reference(sgd, data, loss_scale=hvd.size()))


def test_fp16_compression_within_fp16_tolerance():
    data = batches()
    model, optimizer = start_distributed(sgd, compression=hvd.Compression.fp16)
    train_distributed(model, optimizer, data)
    assert_same_everywhere(model, train_reference(sgd, data), tol=2e-3)


def test_uneven_data_with_join():
    """Rank 0 has one batch more; in that step rank 1 has joined and sends zeros (Average still halves)."""
    data = batches(3)
    model, optimizer = start_distributed(sgd)
    mine = data if hvd.rank() == 0 else data[:2]
    train_distributed(model, optimizer, mine)
    last = hvd.join()
    hvd.broadcast_parameters(model.state_dict(), root_rank=last)
    rank0_half = [(x[: BATCH // 2], y[: BATCH // 2]) for x, y in data[2:]]
    reference = make_model(0)
    optimizer_ref = sgd(reference)
    for (x, y), scale in [(x_y, 1.0) for x_y in data[:2]] + [(x_y, 0.5) for x_y in rank0_half]:
        optimizer_ref.zero_grad()
        (mse(reference, x, y) * scale).backward()
        optimizer_ref.step()
    assert last == 0
    assert_same_everywhere(model, reference)
    # Rank 0 ran more ops than rank 1: Horovod's own names for unnamed ops would now differ and hang.
    assert hvd.allreduce(torch.ones(1), op=hvd.Sum).item() == 2.0


def test_sync_batch_norm_matches_batch_norm_on_the_global_batch():
    data = batches()
    model, optimizer = start_distributed(sgd, batch_norm=hvd.SyncBatchNorm)
    train_distributed(model, optimizer, data)
    reference = train_reference(sgd, data, batch_norm=nn.BatchNorm1d)
    assert_same_everywhere(model, reference)
    model.eval(), reference.eval()
    x = data[0][0]
    assert torch.allclose(model(x), reference(x), atol=TOL)


def test_sparse_embedding_gradients():
    for as_dense in (False, True):
        def build(seed):
            torch.manual_seed(seed)
            return nn.EmbeddingBag(10, 3, mode="mean", sparse=True)
        g = torch.Generator().manual_seed(7)
        data = [(torch.randint(0, 10, (BATCH, 4), generator=g), torch.randn(BATCH, 3, generator=g)) for _ in range(3)]
        model = build(hvd.rank())
        optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5),
                                             model.named_parameters(), sparse_as_dense=as_dense)
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        reference = build(0)
        optimizer_ref = torch.optim.SGD(reference.parameters(), lr=0.5)
        for x, y in data:
            optimizer.zero_grad()
            mse(model, hvd.shard_batch(x), hvd.shard_batch(y)).backward()
            optimizer.step()
            optimizer_ref.zero_grad()
            mse(reference, x, y).backward()
            optimizer_ref.step()
        assert_same_everywhere(model, reference)


def test_distribute_with_the_strategy_api():
    data = batches()
    model = make_model(hvd.rank())
    model, optimizer = hvd.distribute(model, sgd(model), strategy=dualframe.DataParallel(backward_passes_per_step=2))
    train_distributed(model, optimizer, data, passes=2)
    assert_same_everywhere(model, train_reference(sgd, data))


@pytest.mark.skipif(LAUNCHER != "mpirun", reason="Horovod's Adasum needs its MPI controller")
def test_adasum_combines_weight_deltas():
    plain = lambda m: torch.optim.SGD(m.parameters(), lr=0.1)  # noqa: E731
    model, optimizer = start_distributed(plain, op=hvd.Adasum)
    x, y = batches(1)[0]
    start = [p.detach().clone() for p in model.parameters()]
    optimizer.zero_grad()
    mse(model, hvd.shard_batch(x), hvd.shard_batch(y)).backward()
    deltas = [-0.1 * p.grad for p in model.parameters()]
    optimizer.step()
    for p, p0, d in zip(model.parameters(), start, deltas):
        a, b = hvd.allgather(d.unsqueeze(0), name="adasum.check")
        dot = (a * b).sum()
        expected = (1 - dot / (2 * (a * a).sum())) * a + (1 - dot / (2 * (b * b).sum())) * b
        assert torch.allclose(p.detach(), p0 + expected, atol=TOL)


def test_adasum_on_gloo_is_refused_before_communication():
    model = make_model(0)
    if LAUNCHER == "horovodrun":
        with pytest.raises(StrategyError, match="Adasum needs Horovod's MPI controller"):
            hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), op=hvd.Adasum)


def test_bad_input_is_refused_before_communication():
    model = make_model(0)
    fresh = lambda: torch.optim.SGD(model.parameters(), lr=0.1)  # noqa: E731
    named = list(model.named_parameters())
    cases = [
        ({"named_parameters": named[:1] + named[:1] + named[1:]}, r"unique \(duplicates: \['0.weight'\]\)"),
        ({"named_parameters": named[1:]}, r"name every parameter .*1 unnamed"),
        ({"backward_passes_per_step": 0}, r"backward_passes_per_step must be an int >= 1 \(backward_passes_per_step: 0\)"),
        ({"compression": "zip"}, r"unknown compression 'zip'"),
        ({"compression": None}, r"unknown compression None"),
        ({"op": "median"}, r"unknown op 'median'"),
        ({"op": hvd.Sum, "gradient_predivide_factor": 2.0}, r"gradient_predivide_factor only applies to op='average'"),
        ({"groups": 0}, r"groups must be an int >= 1"),
    ]
    for kwargs, message in cases:
        with pytest.raises(StrategyError, match=message):
            hvd.DistributedOptimizer(fresh(), **kwargs)
    wrapped = hvd.DistributedOptimizer(fresh(), named)
    with pytest.raises(StrategyError, match="already a DistributedOptimizer"):
        hvd.DistributedOptimizer(wrapped)
    with pytest.raises(StrategyError, match=r"root_rank must be an int in \[0, 2\) \(root_rank: 2"):
        hvd.broadcast_parameters(model.state_dict(), root_rank=2)
    with pytest.raises(StrategyError, match="unknown op"):
        hvd.allreduce(torch.ones(1), op=99)
    hvd.barrier()  # both ranks are still in step: nothing above communicated


def test_collectives_and_objects():
    r = hvd.rank()
    assert hvd.allgather_object({"rank": r}) == [{"rank": 0}, {"rank": 1}]
    assert hvd.broadcast_object(f"from {r}", root_rank=1) == "from 1"
    assert hvd.allreduce(torch.tensor([r + 1.0]), op=hvd.Max).item() == 2.0
    assert hvd.allreduce(torch.tensor([r + 1.0]), op=hvd.Min).item() == 1.0
    x = torch.tensor([float(r), 10.0 + r])
    assert torch.equal(hvd.reducescatter(x, op=hvd.Sum), torch.tensor([1.0]) if r == 0 else torch.tensor([21.0]))
    assert torch.equal(hvd.alltoall(x), torch.tensor([0.0, 1.0]) if r == 0 else torch.tensor([10.0, 11.0]))
    summed = hvd.grouped_allreduce([torch.ones(2), torch.full((3,), float(r))], op=hvd.Sum)
    assert torch.equal(summed[0], torch.full((2,), 2.0)) and torch.equal(summed[1], torch.ones(3))
    y = torch.full((2,), float(r))
    hvd.broadcast_(y, root_rank=1)
    assert torch.equal(y, torch.ones(2))
    assert hvd.metric_average(float(r)) == 0.5


# --- Sharded optimizer (ZeRO-1/2): equal to plain data parallelism, 1/N of the state per rank ------------------
SHARD_OPTIMIZERS = {
    "sgd-momentum": sgd,
    "adam": lambda m: torch.optim.Adam(m.parameters(), lr=0.01),
    "adamw-decay": lambda m: torch.optim.AdamW(m.parameters(), lr=0.01, weight_decay=0.1),
}


def step_lr(optimizer):
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)


def state_bytes(optimizer):
    return sum(v.numel() * v.element_size() for s in optimizer.state.values() for k, v in s.items()
               if torch.is_tensor(v) and k != "step")


def train_sharded(make_optimizer, data, passes=1, build=make_residual, schedule=False, **wrap):
    model, optimizer = start_distributed(make_optimizer, build=build, **wrap)
    train_distributed(model, optimizer, data, passes, step_lr(optimizer) if schedule else None)
    return model, optimizer


def train_plain(make_optimizer, data, build=make_residual, schedule=False):
    model = build(0)
    optimizer = make_optimizer(model)
    scheduler = step_lr(optimizer) if schedule else None
    for x, y in data:
        optimizer.zero_grad()
        mse(model, x, y).backward()
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
    return model, optimizer


@pytest.mark.parametrize("shard", ["optimizer", "gradients"])
@pytest.mark.parametrize("name", sorted(SHARD_OPTIMIZERS))
def test_sharded_equals_one_process_with_half_the_state(name, shard, monkeypatch):
    data = batches()
    if name == "adamw-decay":  # many small buckets: reduce-scatters collected during backward, gathers windowed
        monkeypatch.setattr(shard_module, "BUCKET_ELEMENTS", 20)
    model, optimizer = train_sharded(SHARD_OPTIMIZERS[name], data, shard=shard, schedule=name == "adam")
    reference, ref_optimizer = train_plain(SHARD_OPTIMIZERS[name], data, schedule=name == "adam")
    assert_same_everywhere(model, reference)
    assert (len(optimizer._slots) > 4) == (name == "adamw-decay")
    assert optimizer.param_groups[0]["lr"] == ref_optimizer.param_groups[0]["lr"]  # StepLR reached the slices
    assert optimizer.inner.param_groups[0]["lr"] == ref_optimizer.param_groups[0]["lr"]
    padding = sum(slot.flat.element_size() for slot in optimizer._slots) * 2
    assert state_bytes(optimizer) <= state_bytes(ref_optimizer) / hvd.size() + padding
    assert state_bytes(optimizer.optimizer) == 0  # the wrapped optimizer never holds state
    grads = [p.grad for p in model.parameters()]
    assert all(g is None for g in grads) if shard == "gradients" else all(g is not None for g in grads)


@pytest.mark.parametrize("shard", ["optimizer", "gradients"])
def test_sharded_backward_passes_per_step_two_half_batches(shard, monkeypatch):
    data = batches()
    monkeypatch.setattr(shard_module, "BUCKET_ELEMENTS", 30)
    adam = SHARD_OPTIMIZERS["adam"]
    model, _ = train_sharded(adam, data, passes=2, shard=shard, backward_passes_per_step=2)
    assert_same_everywhere(model, train_plain(adam, data)[0])


def test_sharded_fp16_compression_equals_plain_fp16():
    data = batches()
    sharded, _ = train_sharded(sgd, data, shard="gradients", compression=hvd.Compression.fp16)
    plain, _ = train_sharded(sgd, data, compression=hvd.Compression.fp16)
    assert_same_everywhere(sharded, plain, tol=1e-3)
    assert_same_everywhere(sharded, train_plain(sgd, data)[0], tol=2e-3)


def test_sharded_on_a_process_set_shards_among_its_ranks():
    """Each rank shards over its own one-rank set: local training on its own half of the batch."""
    data = batches(2)
    model, optimizer = train_sharded(sgd, data, shard="optimizer", process_set=SINGLETONS[hvd.rank()])
    assert optimizer.ranks == 1
    local = [(hvd.shard_batch(x), hvd.shard_batch(y)) for x, y in data]
    reference, _ = train_plain(sgd, local)
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.allclose(p, q, atol=TOL)


def test_sharded_checkpoint_round_trip_and_resize():
    """Full state gathered on every rank loads into a plain optimizer and back, and re-cuts for 1 or 2 ranks."""
    data = batches(6)
    adam = SHARD_OPTIMIZERS["adamw-decay"]
    reference, ref_optimizer = train_plain(adam, data[:3])
    model, optimizer = train_sharded(adam, data[:3], shard="gradients")
    full = optimizer.state_dict()
    ref_full = ref_optimizer.state_dict()
    assert sorted(full["state"]) == sorted(ref_full["state"])
    for i, entry in ref_full["state"].items():
        for key, value in entry.items():
            assert torch.allclose(full["state"][i][key], value, atol=TOL), (i, key)
    # sharded -> plain: a plain optimizer takes the gathered dict and goes on as the sharded one does.
    plain_model = make_residual(0)
    plain_model.load_state_dict(model.state_dict())
    plain = adam(plain_model)
    plain.load_state_dict(full)
    # plain -> sharded, at another size: each rank alone (its one-rank set) on the whole batch.
    alone_model = make_residual(0)
    alone_model.load_state_dict(reference.state_dict())
    alone = hvd.DistributedOptimizer(adam(alone_model), alone_model.named_parameters(), shard="optimizer",
                                     process_set=SINGLETONS[hvd.rank()])
    alone.load_state_dict(ref_full)
    for x, y in data[3:]:
        for m, o, batch in ((plain_model, plain, (x, y)), (reference, ref_optimizer, (x, y)),
                            (alone_model, alone, (x, y)), (model, optimizer, (hvd.shard_batch(x), hvd.shard_batch(y)))):
            o.zero_grad()
            mse(m, *batch).backward()
            o.step()
    assert_same_everywhere(model, reference)
    assert_same_everywhere(plain_model, reference)
    assert_same_everywhere(alone_model, reference)
    # 1 rank -> 2 ranks: the one-rank state, loaded by a sharded optimizer over both ranks.
    grown = hvd.DistributedOptimizer(adam(alone_model), alone_model.named_parameters(), shard="gradients")
    grown.load_state_dict(alone.state_dict())
    assert grown.ranks == 2 and state_bytes(grown) < state_bytes(alone)
    assert all(torch.allclose(grown.state_dict()["state"][i]["exp_avg"], e["exp_avg"], atol=TOL)
               for i, e in ref_optimizer.state_dict()["state"].items())


def test_sharded_bad_input_is_refused_on_every_rank():
    model = make_residual(0)
    fresh = lambda: torch.optim.SGD(model.parameters(), lr=0.1)  # noqa: E731
    cases = [
        ({"shard": "weights"}, fresh, r"unknown shard 'weights'"),
        ({"shard": "optimizer", "op": hvd.Adasum}, fresh, r"needs op Average or Sum \(op: adasum\)"),
        ({"shard": "gradients", "op": hvd.Max}, fresh, r"needs op Average or Sum \(op: max\)"),
        ({"shard": "optimizer", "groups": 2}, fresh, r"drop groups="),
        ({"shard": "optimizer"}, lambda: torch.optim.LBFGS(model.parameters()), r"element-wise optimizer.*LBFGS"),
        ({"shard": "optimizer"}, lambda: torch.optim.Adafactor(model.parameters()), r"element-wise .*Adafactor"),
    ]
    for kwargs, make, message in cases:
        with pytest.raises(StrategyError, match=message):
            hvd.DistributedOptimizer(make(), model.named_parameters(), **kwargs)
    # A parameter set that differs (rank 1 has one layer more): one allgather, then every rank refuses.
    other = nn.Sequential(model, nn.Linear(3, 3)) if hvd.rank() == 1 else nn.Sequential(model)
    with pytest.raises(StrategyError, match=r"same parameters .* rank 1 differs from rank 0 \(parameters: 10 against 8\)"):
        hvd.DistributedOptimizer(torch.optim.SGD(other.parameters(), lr=0.1), other.named_parameters(), shard="optimizer")
    hvd.barrier()  # both ranks are still in step
