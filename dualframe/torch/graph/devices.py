"""A graph stage moved to its device, with the devices its capture recorded in ops (``arange(device=cpu)``).

torch.export records the device an op ran on during capture as a constant argument: GPT-2's position ids
(``torch.arange(..., device=input_ids.device)``) become ``arange(..., device=cpu)`` when the sample was on the
CPU, and a stage placed on ``cuda:0`` would then index a GPU embedding with CPU positions. Moving a stage
therefore also points every recorded device argument of its ops at the stage's device.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx
from torch import nn


def place_stage(stage: nn.Module, device: torch.device) -> None:
    """``stage``'s parameters, buffers and its graphs' (its own and nested ones') device arguments on ``device``.

    Example:
        >>> place_stage(stage_module, torch.device("cuda:0"))   # doctest: +SKIP
    """
    stage.to(device)
    for module in stage.modules():  # nested graphs too (torch.export's autocast / set_grad_enabled regions)
        if isinstance(module, fx.GraphModule) and _retarget_graph(module.graph, device):
            module.recompile()


def _retarget_graph(graph: fx.Graph, device: torch.device) -> bool:
    """Point every device argument of ``graph``'s ops at ``device``; whether any changed."""
    changed = False
    for node in graph.nodes:
        if node.op not in ("call_function", "call_method"):
            continue
        args, kwargs = _retarget(node.args, device), _retarget(node.kwargs, device)
        if args != node.args or kwargs != node.kwargs:
            node.args, node.kwargs, changed = args, kwargs, True
    return changed


def _retarget(value: Any, device: torch.device) -> Any:
    """``value`` with every ``torch.device`` in it (inside tuples, lists, dicts) replaced by ``device``."""
    if isinstance(value, torch.device):
        return device
    if isinstance(value, (tuple, list)):
        return type(value)(_retarget(v, device) for v in value)
    if isinstance(value, dict):
        return {k: _retarget(v, device) for k, v in value.items()}
    return value
