"""``ModelParallel``: an ``nn.Sequential`` split into groups of layers on explicit torch devices."""
from __future__ import annotations

from typing import Iterable, List, Optional, Sequence, Union

import torch
from torch import nn

from dualframe.errors import DeviceError
from dualframe.pipeline.microbatch import micro_batch_sizes
from dualframe.pipeline.split import SplitPlan, plan_split
from dualframe.observe.timeline import Recording
from dualframe.torch.pipe_run import PipeFunction, StepRun, unique_params


def accelerators() -> List[str]:
    """The CUDA devices this process sees, as ``"cuda:<index>"``."""
    return [f"cuda:{k}" for k in range(torch.cuda.device_count())]


def available_devices() -> List[str]:
    """``"cpu"`` then every visible CUDA device."""
    return ["cpu"] + accelerators()


def canonical_device(name: str) -> str:
    """torch's spelling of a device name (``"cuda"`` -> ``"cuda:0"``, ``"cpu:0"`` -> ``"cpu"``).

    Raises:
        DeviceError: torch cannot parse the name.
    """
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError, ValueError) as error:
        raise DeviceError(f"unknown device {name!r}; use 'cpu' or 'cuda:<index>' ({error})") from None
    if device.type == "cpu":
        return "cpu"
    return f"{device.type}:{0 if device.index is None else device.index}"


def _layers(module: Union[nn.Sequential, Iterable[nn.Module]]) -> List[nn.Module]:
    if isinstance(module, nn.Module) and not isinstance(module, nn.Sequential):
        raise TypeError(f"module must be an nn.Sequential or a list of layers (module: {type(module).__name__})")
    layers = list(module)
    for index, layer in enumerate(layers):
        if not isinstance(layer, nn.Module):
            raise TypeError(f"every layer must be an nn.Module (layers[{index}]: {type(layer).__name__})")
    return layers


class ModelParallel(Recording, nn.Module):
    """The module running the strategy ``dualframe.ModelParallel``: an ``nn.Sequential`` in groups on ``devices[j]``.

    The input is moved to the first device, each group's output to the next group's device, and the
    output stays on the last device. Trains with any optimizer; ``parameters()`` are in layer order.

    Example:
        >>> import dualframe.torch as hvd
        >>> model = hvd.ModelParallel(nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2)),
        ...                           balance=[2, 1], devices=["cuda:0", "cuda:1"])  # doctest: +SKIP
        >>> loss = model(torch.randn(4, 8)).sum(); loss.backward()                # doctest: +SKIP

    Args:
        module: an ``nn.Sequential`` (or a list of layers), each layer taking and returning one tensor.
        balance: number of layers per group, summing to the number of layers.
        devices: one device per group (``"cuda:1"``, ``"cpu"``); None: the visible GPUs (under a
            launcher the local rank's share), else ``"cpu"`` repeated.

    Raises:
        BalanceError, DeviceError: before any layer moves, naming the values.
    """

    def __init__(self, module: Union[nn.Sequential, Iterable[nn.Module]], balance: Sequence[int],
                 devices: Optional[Sequence[str]] = None, *, chunks: int = 1, checkpoint: str = "never",
                 schedule: str = "gpipe") -> None:
        super().__init__()
        layers = _layers(module)
        self.plan: SplitPlan = plan_split(len(layers), balance, devices, chunks, checkpoint,
                                          available=available_devices(), canonical=canonical_device,
                                          accelerators=accelerators(), schedule=schedule)
        self.devices = [torch.device(d) for d in self.plan.devices]
        self.partitions = nn.ModuleList(
            nn.Sequential(*[layers[index] for index in r]).to(device)
            for r, device in zip(self.plan.ranges, self.devices)
        )

    @property
    def balance(self) -> List[int]:
        """Layers per group."""
        return self.plan.balance

    @property
    def chunks(self) -> int:
        """Micro-batches per mini-batch (1: no micro-batching)."""
        return self.plan.chunks

    def forward(self, batch: torch.Tensor) -> torch.Tensor:
        """Run the batch through the groups (as ``chunks`` micro-batches); output on the last device."""
        if not isinstance(batch, torch.Tensor):
            raise TypeError(f"the input must be one tensor (got {type(batch).__name__})")
        sizes = micro_batch_sizes(int(batch.shape[0]), self.plan.chunks)
        self._begin_step(int(batch.shape[0]))
        params = [list(stage.parameters()) for stage in self.partitions]
        flat = unique_params(params)
        run = StepRun(list(self.partitions), self.devices, self.plan, torch.split(batch, sizes), params,
                      self.recorder(self.plan.devices), self._lanes())
        grad = torch.is_grad_enabled() and (batch.requires_grad or any(p.requires_grad for p in flat))
        try:
            if not grad:
                return run.forward(grad=False)
            return PipeFunction.apply(run, batch, *flat)
        finally:
            self._end_forward()

    def _lanes(self) -> List[str]:
        """The thread lane of each stage: its device (cells sharing a device run one after another)."""
        return list(self.plan.devices)

    def _begin_step(self, batch: int) -> None:
        """Hook for subclasses: a step of ``batch`` rows starts (after validation)."""

    def _end_forward(self) -> None:
        """Hook for subclasses: the forward cells of a step are done."""

