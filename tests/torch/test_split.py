"""dualframe.torch.ModelParallel and the balance helpers: same numbers as the unsplit module, bad input refused."""
import copy

import pytest
import torch
from torch import nn

import dualframe.torch as hvd
from dualframe.pipeline.split import default_devices
from dualframe.errors import BalanceError, ChunksError, DeviceError, StrategyError


def mlp(seed=0, dtype=torch.float64):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 12), nn.ReLU(), nn.Linear(12, 3)).to(dtype)


def step(model, x):
    x = x.detach().clone().requires_grad_()
    out = model(x)
    out.pow(2).mean().backward()
    return out.detach(), x.grad, [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("balance", [[5], [1, 4], [2, 3], [4, 1], [1, 1, 1, 2]])
def test_outputs_and_gradients_equal_the_unsplit_module(balance):
    reference = mlp()
    split = hvd.ModelParallel(copy.deepcopy(reference), balance, ["cpu"] * len(balance))
    x = torch.randn(7, 6, dtype=torch.float64)
    out, grad_x, grads = step(split, x)
    ref_out, ref_grad_x, ref_grads = step(reference, x)
    torch.testing.assert_close(out, ref_out, atol=1e-6, rtol=0)
    torch.testing.assert_close(grad_x, ref_grad_x, atol=1e-6, rtol=0)
    assert len(grads) == len(ref_grads) == 6
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, atol=1e-6, rtol=0)
    assert split.balance == balance and [len(p) for p in split.partitions] == balance


def test_trains_with_an_optimizer_like_the_unsplit_module():
    reference = mlp(dtype=torch.float32)
    split = hvd.ModelParallel(copy.deepcopy(reference), [2, 3], ["cpu", "cpu"])
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (split, reference)]
    torch.manual_seed(1)
    for _ in range(3):
        x, y = torch.randn(8, 6), torch.randn(8, 3)
        for model, optimizer in zip((split, reference), optimizers):
            optimizer.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
    for a, b in zip(split.parameters(), reference.parameters()):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


def test_no_grad_forward_and_autograd_grad():
    reference = mlp()
    split = hvd.ModelParallel(copy.deepcopy(reference), [3, 2], ["cpu", "cpu"])
    x = torch.randn(4, 6, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(split(x), reference(x), atol=1e-6, rtol=0)
    grads = torch.autograd.grad(split(x).sum(), list(split.parameters()))
    ref = torch.autograd.grad(reference(x).sum(), list(reference.parameters()))
    for g, r in zip(grads, ref):
        torch.testing.assert_close(g, r, atol=1e-6, rtol=0)


def test_devices_omitted_are_the_visible_gpus_else_the_cpu():
    split = hvd.ModelParallel(mlp(), [2, 3])
    expected = default_devices(2, [f"cuda:{k}" for k in range(torch.cuda.device_count())], "cpu")
    assert [str(d) for d in split.devices] == expected
    if not torch.cuda.is_available():
        assert expected == ["cpu", "cpu"]


@pytest.mark.parametrize("balance, devices, error, message", [
    ([2, 2], ["cpu", "cpu"], BalanceError, r"balance must sum to the number of layers \(balance: \[2, 2\] = 2 \+ 2 = 4, layers: 5\)"),
    ([5, 0], ["cpu", "cpu"], BalanceError, r"at least one layer \(balance: \[5, 0\], balance\[1\] = 0\)"),
    ([6, -1], ["cpu", "cpu"], BalanceError, r"balance\[1\] = -1"),
    ([2, 3], ["cpu"], DeviceError, r"len\(devices\) = 1, len\(balance\) = 2"),
    ([2, 3], ["cpu", "gpu7"], DeviceError, r"unknown device 'gpu7'; use 'cpu' or 'cuda:<index>'"),
    ([2, 3], ["cpu", "cuda:3"], DeviceError, r"device 'cuda:3' \(devices\[1\]\) is not available here; available: cpu"),
])
def test_bad_split_refused_before_any_layer_moves(balance, devices, error, message):
    model = mlp()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(error, match=message):
        hvd.ModelParallel(model, balance, devices)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_bad_chunks_and_small_batch_refused():
    with pytest.raises(ChunksError, match=r"chunks must be an int >= 1 \(chunks: 0\)"):
        hvd.Pipeline(mlp(), [2, 3], ["cpu", "cpu"], chunks=0)
    with pytest.raises(StrategyError, match=r"unknown checkpoint 'sometimes'"):
        hvd.Pipeline(mlp(), [2, 3], ["cpu", "cpu"], chunks=2, checkpoint="sometimes")
    pipe = hvd.Pipeline(mlp(), [2, 3], ["cpu", "cpu"], chunks=4)
    with pytest.raises(ChunksError, match=r"batch is smaller than chunks \(batch: 3, chunks: 4\); use chunks <= 3 or a larger batch"):
        pipe(torch.randn(3, 6, dtype=torch.float64))
    with pytest.raises(TypeError, match="module must be an nn.Sequential"):
        hvd.ModelParallel(nn.Linear(2, 2), [1])


def test_balance_by_size_and_by_time():
    model = nn.Sequential(nn.Linear(100, 100), nn.ReLU(), nn.Linear(100, 10), nn.ReLU())
    assert hvd.balance_by_size(model, 2) == [2, 2]  # the first Linear alone is the largest group either way
    assert hvd.balance_by_size(nn.Sequential(*[nn.Linear(10, 10)] * 3, nn.Linear(100, 100)), 2) == [3, 1]
    assert hvd.balance_by_size(model, 4) == [1, 1, 1, 1]
    slow = nn.Sequential(nn.Linear(8, 8), *[nn.Linear(8, 8) for _ in range(3)], nn.Linear(8, 512), nn.Linear(512, 512))
    balance = hvd.balance_by_time(slow, torch.randn(256, 8), 2)
    assert sum(balance) == 6 and balance[1] <= 2, balance  # the two wide layers outweigh the four narrow ones
    assert all(p.grad is None for p in slow.parameters())
    with pytest.raises(BalanceError, match=r"more groups than there are layers \(partitions: 5, layers: 4\)"):
        hvd.balance_by_size(model, 5)
