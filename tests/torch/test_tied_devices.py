"""A weight read by stages on different devices of one process (ModelParallel, Pipeline): a copy per device.

There is no GPU here, so ``tied_devices.COPY_ON_ONE_DEVICE`` makes every later stage hold its own copy
on "cpu": the code path of stages on different GPUs (copy, gradient summed into the model's parameter,
copies following it before each forward). GPT-2 (tied head), a layer called in both halves and a model
whose first and last layers share a weight, float64: the loss and every gradient of each step, and the
weights after 2 steps of SGD with momentum and of Adam, equal the unsplit model's to 1e-9. An
``nn.Sequential`` whose groups on one device share a weight needs no copy: its gradients sum alike.
"""
import copy

import pytest
import torch
from torch import nn

import dualframe.torch as hvd
from dualframe.errors import DeviceError, StrategyError
from dualframe.torch.split import devices as tied_devices
from dualframe.torch.split.model_parallel import check_shared_layers
from dualframe.torch.split.devices import DeviceCopies
from tests.parallel.torch_cases import float_batches, lm_loss, shared_ends, shared_layer, tied_gpt2, token_batches

OPTIMIZERS = {"sgd-momentum": lambda params: torch.optim.SGD(params, lr=0.3, momentum=0.9),
              "adam": lambda params: torch.optim.Adam(params, lr=0.01)}


def gpt2_case():
    model, data = tied_gpt2(), token_batches()
    return model, data, lm_loss, dict(split_points=["lm_head"], sample=(data[0][0],))


def layer_case():
    return shared_layer(), float_batches(), nn.functional.mse_loss, dict(split_points=["mid"])


def ends_case():
    return shared_ends(), float_batches(), nn.functional.mse_loss, dict(split_points=["mid", "last"])


CASES = {"gpt2": gpt2_case, "shared-layer": layer_case, "shared-ends": ends_case}


@pytest.fixture
def copies_on_cpu(monkeypatch):
    monkeypatch.setattr(tied_devices, "COPY_ON_ONE_DEVICE", True)


def copies_of(split):
    return split.graph_stages.copies.copies.values()


def train_alike(split, reference, data, loss_fn, optimizer):
    """Train both with ``optimizer``; each step's loss and every gradient equal to 1e-9."""
    opt, ref_opt = OPTIMIZERS[optimizer](split.parameters()), OPTIMIZERS[optimizer](reference.parameters())
    for x, y in data:
        opt.zero_grad()
        ref_opt.zero_grad()
        loss, expected = loss_fn(split(x), y), loss_fn(reference(x), y)
        loss.backward()
        expected.backward()
        assert loss.item() == pytest.approx(expected.item(), abs=1e-9, rel=0)
        for (name, p), q in zip(split.named_parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, q.grad, atol=1e-9, rtol=0, msg=name)
        opt.step()
        ref_opt.step()


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
@pytest.mark.parametrize("strategy", [hvd.ModelParallel, hvd.Pipeline])
@pytest.mark.parametrize("case", list(CASES))
def test_copies_train_as_the_unsplit_model(copies_on_cpu, case, strategy, optimizer):
    model, data, loss_fn, cut = CASES[case]()
    reference = copy.deepcopy(model)
    n = len(cut["split_points"]) + 1
    split = strategy(model, devices=["cpu"] * n, chunks=2, **cut)
    assert len(copies_of(split)) >= 1 and all(h.copy is not h.master for h in copies_of(split))
    assert list(split.parameters()) == list(model.parameters())  # the masters only: copies are not trained
    assert "copy of " in split.describe()
    train_alike(split, reference, data, loss_fn, optimizer)
    got, want = split.state_dict(), reference.state_dict()
    assert list(got) == list(want)
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, atol=1e-9, rtol=0, msg=key)
    split.graph_stages.copies.sync()
    for held in copies_of(split):
        assert torch.equal(held.copy, held.master), held.name


def test_a_loaded_state_reaches_the_copies(copies_on_cpu):
    model, data, loss_fn, cut = gpt2_case()
    other = tied_gpt2()
    with torch.no_grad():
        for p in other.parameters():
            p.add_(0.1 * torch.randn_like(p))
    split = hvd.ModelParallel(model, devices=["cpu", "cpu"], **cut)
    split(data[0][0])
    split.load_state_dict(other.state_dict())
    x, y = data[1]
    assert loss_fn(split(x), y).item() == pytest.approx(loss_fn(other(x), y).item(), abs=1e-9, rel=0)


def test_stages_on_one_device_share_the_parameter_without_copies():
    model, _, _, cut = layer_case()
    split = hvd.Pipeline(model, devices=["cpu", "cpu"], **cut)
    assert not list(copies_of(split))
    assert "copy of " not in split.describe()


def test_one_copy_per_later_device_and_none_on_the_masters():
    shared = nn.Linear(2, 2)
    stages = [nn.Sequential(shared), nn.Sequential(shared), nn.Sequential(shared), nn.Sequential(shared)]
    devices = [torch.device(d) for d in ("meta", "cpu", "meta", "cpu")]
    copies = DeviceCopies(devices, {id(shared.weight): ["shared.weight"], id(shared.bias): ["shared.bias"]})
    copies.place(stages)
    assert stages[0][0] is shared and stages[2][0] is shared  # the master's device reads the master
    assert stages[1][0] is not shared and stages[1][0].weight is stages[3][0].weight  # one copy per device
    assert copies.masters[id(stages[1][0].weight)] is shared.weight and shared.weight.device.type == "cpu"
    assert [line.split(" (")[0] for line in copies.describe()] == [
        "  copy of shared.weight on cpu for stages on cpu", "  copy of shared.bias on cpu for stages on cpu"]


def test_a_copied_buffer_changed_in_place_is_refused(copies_on_cpu):
    norm = nn.BatchNorm1d(6).double()
    model = nn.Sequential(norm, nn.Linear(6, 6), norm).double()
    split = hvd.ModelParallel(model, split_points=["1"], devices=["cpu", "cpu"])
    split(torch.randn(4, 6, dtype=torch.float64))  # stage 1's copy of the running statistics moves
    with pytest.raises(StrategyError, match="changed its copy in place; keep such a buffer read-only"):
        split(torch.randn(4, 6, dtype=torch.float64))


def test_a_sequential_split_refuses_layers_sharing_a_weight_on_two_devices():
    layers = list(shared_ends(sequential=True))
    with pytest.raises(DeviceError, match=r"groups 0 \(cuda:0\) and 2 \(cuda:1\) share 'weight'; cut the model as "):
        check_shared_layers([layers[:2], layers[2:4], layers[4:]], ["cuda:0", "cuda:0", "cuda:1"])
    check_shared_layers([layers[:2], layers[2:4], layers[4:]], ["cuda:0", "cuda:1", "cuda:0"])


@pytest.mark.parametrize("strategy", [hvd.ModelParallel, hvd.Pipeline])
def test_a_sequential_split_sharing_a_weight_on_one_device_trains_as_unsplit(strategy):
    model, data = shared_ends(sequential=True), float_batches()
    reference = copy.deepcopy(model)
    split = strategy(model, [2, 2, 1], ["cpu"] * 3, chunks=2)
    assert len(list(split.parameters())) == len(list(reference.parameters())) == 5  # the shared weight once
    train_alike(split, reference, data, nn.functional.mse_loss, "sgd-momentum")
    for p, q in zip(split.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, atol=1e-9, rtol=0)
