"""dualframe.torch data parallelism in one process (size 1): checks, wrapper behaviour, SyncBatchNorm maths."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import dualframe
import dualframe.torch as hvd
from dualframe.errors import StrategyError
from dualframe.dp.scaling import warmup_factor
from dualframe.torch.dp.sync_batch_norm import _SyncBatchNormFunction


@pytest.fixture(scope="module", autouse=True)
def started():
    hvd.init()
    assert hvd.size() == 1


def model_and_sgd(seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 2))
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


@pytest.mark.parametrize("kwargs, message", [
    ({"named_parameters": "dup"}, r"unique \(duplicates: \['0.weight'\]\)"),
    ({"named_parameters": "missing"}, r"name every parameter of the optimizer \(1 unnamed"),
    ({"named_parameters": [("w", 3.0)]}, r"\(name, parameter\) pairs"),
    ({"backward_passes_per_step": 0}, r"backward_passes_per_step must be an int >= 1 \(backward_passes_per_step: 0\)"),
    ({"backward_passes_per_step": 1.5}, r"backward_passes_per_step: 1.5"),
    ({"compression": "bz2"}, r"unknown compression 'bz2'; choose one of none, fp16"),
    ({"compression": object()}, r"unknown compression <object"),
    ({"op": "mean"}, r"unknown op .mean.; use one of hvd.Average"),
    ({"op": 42}, r"unknown op 42"),
    ({"gradient_predivide_factor": 0.0}, r"gradient_predivide_factor must be a number > 0"),
    ({"groups": -1}, r"groups must be an int >= 1 .*\(groups: -1\)"),
    ({"groups": [[torch.zeros(1, requires_grad=True)]]}, r"groups\[0\] holds something that is not a parameter"),
    ({"process_set": hvd.ProcessSet([0])}, r"is not registered"),
    ({"process_set": [0]}, r"process_set must be an hvd.ProcessSet"),
])
def test_bad_arguments_are_refused(kwargs, message):
    model, sgd = model_and_sgd()
    named = list(model.named_parameters())
    if kwargs.get("named_parameters") == "dup":
        kwargs = {"named_parameters": named[:1] + named}
    elif kwargs.get("named_parameters") == "missing":
        kwargs = {"named_parameters": named[:-1]}
    with pytest.raises(StrategyError, match=message):
        hvd.DistributedOptimizer(sgd, **kwargs)
    hvd.DistributedOptimizer(sgd, named)  # nothing was marked wrapped by the refused attempt


def test_a_wrapper_is_refused_and_an_optimizer_wrapped_again_is_reduced_by_its_newest_wrapper():
    model, sgd = model_and_sgd()
    wrapped = hvd.DistributedOptimizer(sgd, model.named_parameters())
    with pytest.raises(StrategyError, match="already a DistributedOptimizer"):
        hvd.DistributedOptimizer(wrapped)
    with pytest.raises(StrategyError, match="must be a torch.optim.Optimizer"):
        hvd.DistributedOptimizer(model)
    again = hvd.DistributedOptimizer(sgd, model.named_parameters())  # as Horovod allows
    assert isinstance(again, torch.optim.SGD) and type(again) is type(wrapped)
    from dualframe.torch.dp.wrapped_optimizer import OWNERS
    assert OWNERS[sgd][0]() is again
    with pytest.raises(StrategyError, match="sharded wrapper must be its optimizer's only one"):
        hvd.DistributedOptimizer(sgd, model.named_parameters(), shard="optimizer")


def test_the_wrapper_is_an_instance_of_the_users_optimizer_class():
    model, _ = model_and_sgd()
    adam = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01))
    assert isinstance(adam, torch.optim.Adam) and isinstance(adam, hvd.DistributedOptimizer)
    assert type(adam).__name__ == "DistributedOptimizer" and adam.defaults["lr"] == 0.01
    assert not isinstance(adam, torch.optim.SGD)


def test_one_process_training_equals_the_plain_optimizer_and_shares_its_state():
    x, y = torch.randn(8, 4), torch.randn(8, 2)
    plain_model, plain = model_and_sgd()
    model, sgd = model_and_sgd()
    wrapped = hvd.DistributedOptimizer(sgd, model.named_parameters(), compression="fp16")
    scheduler = torch.optim.lr_scheduler.StepLR(wrapped, step_size=1, gamma=0.5)  # needs an Optimizer
    for _ in range(3):
        for m, opt in ((plain_model, plain), (model, wrapped)):
            opt.zero_grad()
            F.mse_loss(m(x), y).backward()
            opt.step()
        for group in plain.param_groups:
            group["lr"] *= 0.5
        scheduler.step()
    for a, b in zip(plain_model.parameters(), model.parameters()):
        assert torch.equal(a, b)
    assert wrapped.param_groups is sgd.param_groups and wrapped.state is sgd.state
    assert wrapped.state_dict()["state"].keys() == plain.state_dict()["state"].keys()
    wrapped.load_state_dict(plain.state_dict())
    assert wrapped.param_groups[0]["lr"] == plain.param_groups[0]["lr"]
    with wrapped.skip_synchronize():
        wrapped.step()
    assert "DistributedOptimizer(op=average" in repr(wrapped)


def test_add_param_group_is_reduced_too():
    model, sgd = model_and_sgd()
    wrapped = hvd.DistributedOptimizer(sgd, list(model.named_parameters())[:2] + list(model.named_parameters())[2:])
    extra = nn.Parameter(torch.ones(3))
    wrapped.add_param_group({"params": [extra], "lr": 0.5})
    assert wrapped._names[extra] == "allreduce.noname.1.0" and extra in wrapped._delay


def test_distribute_takes_data_parallel_only():
    model, sgd = model_and_sgd()
    with pytest.raises(StrategyError, match="applies dualframe.DataParallel .*ModelParallel"):
        hvd.distribute(model, sgd, strategy=dualframe.ModelParallel(balance=[1, 2]))
    model, wrapped = hvd.distribute(model, sgd, strategy=dualframe.DataParallel(compression="fp16"))
    assert isinstance(wrapped, hvd.DistributedOptimizer) and wrapped.optimizer is sgd


def test_fp16_compression_is_the_core_compressor():
    grad = torch.tensor([1.0, 1e-4, 3.14159], dtype=torch.float32)
    sent, ctx = hvd.Compression.fp16.compress(grad)
    assert sent.dtype == torch.float16 and ctx == "float32"
    back = hvd.Compression.fp16.decompress(sent, ctx)
    assert back.dtype == torch.float32 and torch.allclose(back, grad, rtol=1e-3)
    assert hvd.Compression.none.compress(grad) == (grad, None)


def test_warmup_scheduler_scales_by_world_size():
    assert [warmup_factor(k, 4, 4) for k in (0, 2, 4, 9)] == [1.0, 2.5, 4.0, 4.0]
    with pytest.raises(StrategyError, match="warmup_steps must be an int >= 0"):
        warmup_factor(0, -1, 2)
    _, sgd = model_and_sgd()
    scheduler = hvd.warmup_lr_scheduler(sgd, warmup_steps=2, world_size=3)
    lrs = []
    for _ in range(4):
        lrs.append(round(sgd.param_groups[0]["lr"], 6))
        sgd.step()
        scheduler.step()
    assert lrs == [0.1, 0.2, 0.3, 0.3]


def test_conveniences_at_size_one():
    batch = torch.arange(10)
    assert torch.equal(hvd.shard_batch(batch), batch)
    assert hvd.metric_average(torch.tensor(0.25)) == 0.25
    assert list(hvd.progress(range(5), desc="t")) == [0, 1, 2, 3, 4]
    sampler = hvd.distributed_sampler(torch.utils.data.TensorDataset(batch), shuffle=False)
    assert list(sampler) == list(range(10))
    assert hvd.is_root()
    with pytest.raises(StrategyError, match=r"root_rank must be an int in \[0, 1\)"):
        hvd.broadcast_parameters(nn.Linear(1, 1).state_dict(), root_rank=1)
    with pytest.raises(StrategyError, match="needs a torch.Tensor"):
        hvd.allreduce([1.0, 2.0])


@pytest.mark.parametrize("shape", [(6, 3), (4, 3, 5, 2)])
def test_sync_batch_norm_maths_equal_batch_norm(shape):
    """The autograd function on one rank (the allreduce is then the identity) is batch norm exactly."""
    torch.manual_seed(1)
    x = torch.randn(*shape, dtype=torch.float64, requires_grad=True)
    w = torch.randn(3, dtype=torch.float64, requires_grad=True)
    b = torch.randn(3, dtype=torch.float64, requires_grad=True)
    mean, var = torch.zeros(3, dtype=torch.float64), torch.ones(3, dtype=torch.float64)
    mean_ref, var_ref = mean.clone(), var.clone()
    out = _SyncBatchNormFunction.apply(x, w, b, mean, var, 1e-5, 0.1, hvd.global_process_set)
    grads = torch.autograd.grad((out * out.detach().sin()).sum(), (x, w, b))
    ref = F.batch_norm(x, mean_ref, var_ref, w, b, True, 0.1, 1e-5)
    grads_ref = torch.autograd.grad((ref * ref.detach().sin()).sum(), (x, w, b))
    assert torch.allclose(out, ref, atol=1e-10)
    assert torch.allclose(mean, mean_ref) and torch.allclose(var, var_ref)
    for g, g_ref in zip(grads, grads_ref):
        assert torch.allclose(g, g_ref, atol=1e-9)


def test_sync_batch_norm_layer_is_batch_norm_on_one_process():
    torch.manual_seed(2)
    layer, ref = hvd.SyncBatchNorm(4), nn.BatchNorm1d(4)
    x = torch.randn(8, 4)
    assert torch.allclose(layer(x), ref(x), atol=1e-6)
    layer.eval(), ref.eval()
    assert torch.allclose(layer(x), ref(x), atol=1e-6)
    with pytest.raises(ValueError, match="at least 2 dimensions"):
        layer(torch.randn(4))
