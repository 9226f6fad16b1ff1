"""A tensor read by stages on different devices of one process: the model's own on one device, a copy on each other.

GPT-2's ``lm_head.weight`` is ``transformer.wte.weight``; split with the head on ``cuda:1`` and the
embedding on ``cuda:0``, one tensor cannot be on both. As DeepSpeed's ``TiedLayerSpec`` does across
processes, each device holds its own copy: the model's parameter (the master) stays with the lowest
stage that reads it, each later stage on another device reads a copy made there. The copies'
gradients are summed into the master's (``masters`` tells the step which master a copy stands for),
so the optimizer, built from the split model's ``parameters()`` (the masters only), sees the unsplit
model's gradient; after it updates the master, ``sync()`` (run before every forward) copies the new
values to the copies, so they are equal whenever a stage reads them. ``state_dict()`` and
``load_state_dict()`` see the masters only, under the model's own keys.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Dict, Hashable, List, Mapping, Sequence, Tuple

import torch
from torch import nn

from dualframe.errors import StrategyError

#: Give every later stage its own copy even where its device is the master's (how the CPU tests run the
#: code path of stages on different GPUs); read when a split is built.
COPY_ON_ONE_DEVICE = False


@dataclass
class _Copy:
    """One copy of a master tensor on one device, with what ``sync`` last saw of both."""

    name: str
    master: torch.Tensor
    copy: torch.Tensor
    seen: Tuple[int, int] = (-1, 0)  # the master's (version, data_ptr) when last copied
    own_version: int = 0  # the copy's version right after that copy: a later change was made in place by a stage


class DeviceCopies:
    """The copies of the tensors that stages on different devices read, and their masters.

    Args:
        devices: each stage's device.
        names: per tensor (``id``), the model's names for it (``tied.tensor_names``), for messages.
        one_device: give every later stage a copy even on the master's device (``COPY_ON_ONE_DEVICE``).

    Example:
        >>> copies = DeviceCopies([torch.device("cpu")] * 2, {}, one_device=True)
        >>> shared = nn.Linear(2, 2)
        >>> stages = [nn.Sequential(shared), nn.Sequential(shared)]
        >>> copies.place(stages)
        >>> stages[1][0].weight is shared.weight, copies.masters[id(stages[1][0].weight)] is shared.weight
        (False, True)
    """

    def __init__(self, devices: Sequence[torch.device], names: Mapping[int, Sequence[str]],
                 one_device: bool = False) -> None:
        self.devices, self.names, self.one_device = list(devices), names, one_device
        self.copies: Dict[Tuple[int, Hashable], _Copy] = {}
        self.masters: Dict[int, torch.Tensor] = {}  # id(copy) -> its master

    def place(self, stages: Sequence[nn.Module]) -> None:
        """Each stage j reading a tensor that a lower stage reads on another device gets a copy on device j.

        Stages on one device share one copy (each its own with ``one_device``); modules of the model on
        the way to a copied tensor are replaced in stage j by shallow clones, so the model is unchanged.
        """
        holders: Dict[int, List[int]] = {}
        tensors: Dict[int, torch.Tensor] = {}
        for j, stage in enumerate(stages):
            for tensor in [*stage.parameters(), *stage.buffers()]:
                tensors[id(tensor)] = tensor
                if j not in holders.setdefault(id(tensor), []):
                    holders[id(tensor)].append(j)
        wanted: List[Dict[int, torch.Tensor]] = [{} for _ in stages]
        for key, js in holders.items():
            root = js[0]
            for j in js[1:]:
                if self.one_device or self.devices[j] != self.devices[root]:
                    wanted[j][key] = self._copy(tensors[key], j).copy
        for stage, replace in zip(stages, wanted):
            if replace:
                substitute(stage, replace)

    def _copy(self, master: torch.Tensor, j: int) -> _Copy:
        where: Hashable = j if self.one_device else self.devices[j]
        held = self.copies.get((id(master), where))
        if held is None:
            name = (self.names.get(id(master)) or ["a tensor"])[0]
            value = master.detach().to(self.devices[j], copy=True)
            twin = nn.Parameter(value, master.requires_grad) if isinstance(master, nn.Parameter) else value
            held = self.copies[(id(master), where)] = _Copy(name, master, twin)
            self.masters[id(twin)] = master
            self._refresh(held)
        return held

    def describe(self) -> List[str]:
        """One line per copy, for ``describe()``: the tensor's name and the device of its copy."""
        return [f"  copy of {held.name} on {held.copy.device} for stage{'' if self.one_device else 's on'} {where} "
                "(takes its values before each forward, its gradient summed into the model's)"
                for (_, where), held in self.copies.items()]

    def sync(self) -> None:
        """Every copy takes its master's values where the master changed (an optimizer step, a load).

        Raises:
            StrategyError: a stage changed a copied buffer in place (a shared BatchNorm's statistics),
                which the other devices would not see; naming it.
        """
        for held in self.copies.values():
            if held.copy._version != held.own_version:
                raise StrategyError(f"{held.name!r} is read by stages on different devices, and a stage changed its "
                                    f"copy in place; keep such a buffer read-only, or put its stages on one device")
            if (held.master._version, held.master.data_ptr()) != held.seen:
                self._refresh(held)

    def _refresh(self, held: _Copy) -> None:
        master, twin = held.master, held.copy
        with torch.no_grad():
            if twin.shape != master.shape or twin.dtype != master.dtype:  # model.double() after the split
                twin.data = master.detach().to(twin.device, copy=True)
            else:
                twin.copy_(master, non_blocking=True)
        if isinstance(twin, nn.Parameter):
            twin.requires_grad_(master.requires_grad)
        held.seen, held.own_version = (master._version, master.data_ptr()), twin._version


def substitute(module: nn.Module, replace: Mapping[int, torch.Tensor]) -> None:
    """In ``module``'s tree, each tensor whose ``id`` is in ``replace`` read through ``replace[id]`` instead.

    ``module`` itself is changed; every submodule on the way to a replaced tensor is first replaced by a
    shallow clone (its own dicts of parameters, buffers and children), so modules shared with the model
    or with other stages keep their tensors.
    """
    for name, child in list(module._modules.items()):
        if child is not None and any(id(t) in replace for t in _tensors(child)):
            clone = copy.copy(child)
            clone._parameters, clone._buffers = dict(child._parameters), dict(child._buffers)
            clone._modules = dict(child._modules)
            substitute(clone, replace)
            module._modules[name] = clone
    for store in (module._parameters, module._buffers):
        for name, tensor in list(store.items()):
            if tensor is not None and id(tensor) in replace:
                store[name] = replace[id(tensor)]  # type: ignore[assignment]


def _tensors(module: nn.Module) -> List[torch.Tensor]:
    named = [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]
    return [tensor for _, tensor in named]
