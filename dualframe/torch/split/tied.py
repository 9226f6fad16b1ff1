"""Tied weights of a torch split: found by identity, the holders' copies kept equal, state dicts under every name.

A parameter is tied when several stages read the same ``nn.Parameter`` object (GPT-2's ``lm_head.weight``
is ``transformer.wte.weight``). In a process pipeline each holding rank keeps its own copy, which starts
as the lowest holder's (a broadcast at build) and whose gradient is summed over the holders before the
optimizer step (``dualframe.pipeline.tied``). A stage's state dict names a weight the model knows under
several names by all of them, so the stages' dicts merge into the unsplit model's. In one process
(``ModelParallel``, ``Pipeline``) a tensor read by stages on different devices is the model's own on the
lowest such stage's device and a copy on each other device (``tied_devices.DeviceCopies``).
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
from torch import nn

from dualframe.pipeline.tied import TiedPlan, TiedWeight, find_tied, sum_tied
from dualframe.torch.collectives import hvd


def tensor_names(module: nn.Module) -> Dict[int, List[str]]:
    """Per parameter or buffer (by ``id``), every name ``module`` has for it, in its ``state_dict`` order."""
    names: Dict[int, List[str]] = {}
    for name, tensor in [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]:
        names.setdefault(id(tensor), []).append(name)
    return names


def find_stage_tied(module: nn.Module, stages: Sequence[nn.Module]) -> List[TiedWeight]:
    """The parameters of ``module`` that more than one of its ``stages`` reads (stages reference its parameters).

    Example:
        >>> tied = find_stage_tied(gpt2, [part.module(0), part.module(1)])   # doctest: +SKIP
        >>> tied[0].names, tied[0].stages                                     # doctest: +SKIP
        (('transformer.wte.weight', 'lm_head.weight'), (0, 1))
    """
    names = tensor_names(module)
    params = {id(p) for p in module.parameters()}
    return find_tied([[id(p) for p in stage.parameters() if id(p) in params] for stage in stages], names)


def model_state_dict(stage: nn.Module, names: Mapping[int, Sequence[str]], *args: Any, **kwargs: Any) -> Dict[str, Any]:
    """``stage.state_dict()`` with each tensor the model names several ways under all its names, in the model's order.

    A captured stage knows a tied weight by one name (torch.export keeps the last, ``lm_head.weight``);
    the model has both, so a stage's dict lists it under both and the stages' dicts merge into the model's.
    """
    state = stage.state_dict(*args, **kwargs)
    prefix = kwargs.get("prefix", args[1] if len(args) > 1 else "")
    held = dict([*stage.named_parameters(remove_duplicate=False), *stage.named_buffers(remove_duplicate=False)])
    out: Dict[str, Any] = OrderedDict()
    for key, value in state.items():
        tensor = held.get(key[len(prefix):]) if key.startswith(prefix) else None
        aliases = names.get(id(tensor), ()) if tensor is not None else ()
        for name in (aliases if len(aliases) > 1 else [key[len(prefix):]]):
            out[prefix + name] = value
    return out


def stage_part(stage: nn.Module, names: Mapping[int, Sequence[str]], state_dict: Mapping[str, Any]) -> Dict[str, Any]:
    """The entries of a full model's ``state_dict`` that ``stage`` holds, under the stage's own keys.

    A tied weight is taken under the stage's name, else under the first of the model's names for it present.
    """
    held = dict([*stage.named_parameters(remove_duplicate=False), *stage.named_buffers(remove_duplicate=False)])
    part: Dict[str, Any] = OrderedDict()
    for key in stage.state_dict():
        tensor = held.get(key)
        candidates = [key, *(names.get(id(tensor), ()) if tensor is not None else ())]
        found = next((name for name in candidates if name in state_dict), None)
        if found is not None:
            part[key] = state_dict[found]
    return part


class TiedCopies:
    """This rank's copies of the tied weights of a process pipeline: equal at build, gradients summed each step.

    Args:
        plan: this rank's ``TiedPlan``.
        stage: the local stage (its parameters are the model's objects).
        module: the whole model (for each weight's names).
        sets: Horovod process sets by sorted ranks (``open_stage``'s).
        prefix: the pipeline's name (``dpipe0``), for Horovod's operation names.

    Example:
        >>> copies = TiedCopies(plan, pipe.stage, model, pipe.role.sets, "dpipe0")   # doctest: +SKIP
        >>> copies.broadcast(); loss.backward(); copies.sum_gradients()               # doctest: +SKIP
    """

    def __init__(self, plan: TiedPlan, stage: nn.Module, module: nn.Module, sets: Mapping[Tuple[int, ...], Any],
                 prefix: str) -> None:
        by_name = dict(module.named_parameters(remove_duplicate=False))
        local = {id(p) for p in stage.parameters()}
        self.plan, self.sets, self.prefix = plan, sets, prefix
        self.params: Dict[str, nn.Parameter] = {}
        for weight in plan.mine:
            param = by_name[weight.key]
            assert id(param) in local, f"stage holds no copy of tied weight {weight.key!r}"
            self.params[weight.key] = param

    def _set(self, ranks: Tuple[int, ...]) -> Any:
        return self.sets.get(tuple(sorted(ranks)), hvd.global_process_set)

    def broadcast(self) -> None:
        """Every holder's copy becomes the lowest holding stage's (a collective over each weight's holders)."""
        for weight in self.plan.mine:
            param = self.params[weight.key]
            with torch.no_grad():
                hvd.broadcast_(param.data, self.plan.root_rank(weight), name=f"{self.prefix}.tied_init.{weight.key}",
                               process_set=self._set(self.plan.ranks(weight)))

    def sum_gradients(self) -> None:
        """Each tied weight's gradient summed over its holders (zeros where this stage's backward gave none)."""
        if not self.plan.mine:
            return
        grads = {key: (p.grad if p.grad is not None else torch.zeros_like(p)) for key, p in self.params.items()}

        def reduce(tensor: torch.Tensor, name: str, ranks: Tuple[int, ...]) -> torch.Tensor:
            return hvd.allreduce(tensor, op=hvd.Sum, name=name, process_set=self._set(ranks))

        for key, summed in sum_tied(self.plan, grads, reduce, self.prefix).items():
            param = self.params[key]
            if param.grad is None:
                param.grad = summed
            else:
                param.grad.copy_(summed)

    def before_step(self, optimizer: torch.optim.Optimizer) -> Optional[Any]:
        """Sum the tied gradients in ``optimizer``'s step, before it updates (after a wrapper's replica averaging)."""
        if not self.plan.mine:
            return None
        return optimizer.register_step_pre_hook(lambda *_: self.sum_gradients())
