"""Balance helpers for torch: split layers evenly by parameter size or by measured time."""
from __future__ import annotations

import statistics
import time
from typing import Iterable, List, Union

import torch
from torch import nn

from dualframe.pipeline.partition import balance_by_cost


def balance_by_size(module: Union[nn.Sequential, Iterable[nn.Module]], partitions: int) -> List[int]:
    """Balance whose groups hold about the same parameter bytes (the largest group as small as can be).

    Example:
        >>> balance_by_size(nn.Sequential(nn.Linear(100, 100), nn.ReLU(), nn.Linear(100, 10)), 2)
        [1, 2]
    """
    costs = [float(sum(p.numel() * p.element_size() for p in layer.parameters())) for layer in module]
    return balance_by_cost(costs, partitions)


def layer_times(module: Union[nn.Sequential, Iterable[nn.Module]], sample: torch.Tensor,
                repeats: int = 3) -> List[float]:
    """Median seconds of forward + backward of each layer on ``sample`` (layer by layer, in order)."""
    layers = list(module)
    times: List[List[float]] = [[] for _ in layers]
    for repeat in range(repeats + 1):  # the first pass warms up (allocations, kernels) and is not counted
        x = sample
        for index, layer in enumerate(layers):
            x = x.detach()
            if x.is_floating_point():
                x.requires_grad_()
            _sync(x)
            start = time.perf_counter()
            y = layer(x)
            if y.requires_grad:
                y.backward(torch.ones_like(y))
            _sync(y)
            if repeat:
                times[index].append(time.perf_counter() - start)
            x = y
    for layer in layers:
        layer.zero_grad(set_to_none=True)
    return [statistics.median(t) for t in times]


def balance_by_time(module: Union[nn.Sequential, Iterable[nn.Module]], sample: torch.Tensor,
                    partitions: int, repeats: int = 3) -> List[int]:
    """Balance whose groups take about the same measured time on ``sample`` (forward + backward).

    Measure on the device the layers are on now, with a batch like the training one (a micro-batch
    for a Pipeline). Gradients left by the measurement are cleared.

    Example:
        >>> model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(8)])
        >>> balance = balance_by_time(model, torch.randn(32, 64), partitions=2)  # doctest: +SKIP
    """
    return balance_by_cost(layer_times(module, sample, repeats), partitions)


def _sync(tensor: torch.Tensor) -> None:
    if tensor.is_cuda:
        torch.cuda.synchronize(tensor.device)
