"""``ModelParallel``: a torch model split into groups on explicit devices (an ``nn.Sequential``'s layers, or any
model's graph cut at named modules, by units or by measured cost)."""
from __future__ import annotations

import dataclasses
from typing import Any, Dict, Iterable, List, Optional, Sequence, Union

import torch
from torch import nn

from dualframe.errors import BalanceError, DeviceError, StrategyError
from dualframe.pipeline.graph import stage_count
from dualframe.pipeline.microbatch import micro_batch_sizes
from dualframe.pipeline.split import Split, validate_split
from dualframe.observe.timeline import Recording
from dualframe.torch.graph.capture import Leaves
from dualframe.torch.graph.run import batch_size, split_inputs, tensor_leaves, unique_params
from dualframe.torch.split.chain import ChainStages
from dualframe.torch.split.graph import GraphFunction, GraphStages, Layout


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


def is_graph_split(module: Any, split_points: Any, stages: Any) -> bool:
    """Whether ``module`` is captured and cut as a graph (any module but a Sequential, or any module given
    split_points/stages) rather than its layers grouped by ``balance`` into a chain."""
    if split_points is not None or stages is not None:
        return True
    return isinstance(module, nn.Module) and not isinstance(module, nn.Sequential)


def _one_layer(module: nn.Module) -> bool:
    """A single torch.nn layer (nn.Linear, ...): nothing inside it to cut."""
    return type(module).__module__.startswith("torch.nn") and not any(True for _ in module.children())


def _layers(module: Union[nn.Sequential, Iterable[nn.Module]]) -> List[nn.Module]:
    layers = list(module)
    for index, layer in enumerate(layers):
        if not isinstance(layer, nn.Module):
            raise TypeError(f"every layer must be an nn.Module (layers[{index}]: {type(layer).__name__})")
    return layers


def check_shared_layers(groups: Sequence[Sequence[nn.Module]], devices: Sequence[str]) -> None:
    """Refuse layers of a Sequential split on different devices that share a parameter or buffer.

    A Sequential's groups hold the layers themselves, so a shared tensor cannot be on two devices; a
    graph split gives each device its own copy.

    Raises:
        DeviceError: naming the tensor, the groups and their devices.
    """
    first: Dict[int, int] = {}
    for j, group in enumerate(groups):
        for layer in group:
            for name, tensor in [*layer.named_parameters(), *layer.named_buffers()]:
                k = first.setdefault(id(tensor), j)
                if devices[k] != devices[j]:
                    raise DeviceError(f"groups {k} ({devices[k]}) and {j} ({devices[j]}) share {name!r}; cut the model "
                                      "as a graph (split_points=[...]): each device then holds a copy, their "
                                      "gradients summed")


class ModelParallel(Recording, nn.Module):
    """The module running the strategy ``dualframe.ModelParallel``: a torch model in groups (stages) on ``devices[j]``.

    An ``nn.Sequential`` (or a list of layers) with ``balance`` is split into groups of layers. Any other
    model, or any model given ``split_points`` or ``stages``, is captured as a graph (torch.fx; torch.export
    on ``sample`` where fx cannot trace) and cut where a new stage begins: at the qualified module names
    ``split_points``, after ``balance`` top-level units, or, with ``stages=n`` alone, where the measured
    cost per stage on ``sample`` is even and little crosses. Each value a stage computes goes to the
    device of every later stage that reads it; the outputs stay on the devices that made them.
    ``state_dict()`` keeps the original model's keys, ``parameters()`` its order. A parameter that stages
    on different devices read (a tied head) is copied to the later devices, the copies' gradients summed
    into it and their values renewed from it before each forward (``dualframe.torch.split.devices``). A model
    that computes its own loss (a Hugging Face model given ``labels=``) returns it as with the unsplit
    model, over ``chunks`` micro-batches their losses weighted by rows (``dualframe.torch.split.loss``).

    Example:
        >>> import dualframe.torch as hvd
        >>> model = hvd.ModelParallel(nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2)),
        ...                           balance=[2, 1], devices=["cuda:0", "cuda:1"])  # doctest: +SKIP
        >>> split = hvd.ModelParallel(resnet, split_points=["layer3"], devices=["cuda:0", "cuda:1"])  # doctest: +SKIP
        >>> print(split.describe())                                              # doctest: +SKIP

    Args:
        module: an ``nn.Sequential`` (or a list of layers) split by ``balance``, or any ``nn.Module``.
        balance: layers per group (Sequential), or top-level units per stage (a graph, see ``graph_units``).
        devices: one device per group (``"cuda:1"``, ``"cpu"``); None: the visible GPUs (under a
            launcher the local rank's share), else ``"cpu"`` repeated.
        split_points: qualified names of the submodules where stages 1..n-1 begin (``["layer3", "blocks.6"]``).
        stages: number of stages, cut where dualframe finds best (measured on ``sample``; without one,
            by parameter bytes).
        sample: one call's inputs (a tuple of positional arguments, or the only argument) for ``stages``,
            for the torch.export fallback and for ``describe()`` before the first step.
        by: what ``stages`` evens out: ``"time"`` (forward seconds per node) or ``"memory"``
            (parameter and activation bytes).
        leaves: module names or classes kept whole (never cut inside) beyond torch.nn's own.

    Raises:
        BalanceError, SplitPointError, DeviceError, TraceError: before any layer moves, naming the values.
    """

    def __init__(self, module: Union[nn.Module, Iterable[nn.Module]], balance: Optional[Sequence[int]] = None,
                 devices: Optional[Sequence[str]] = None, *, chunks: int = 1, checkpoint: str = "never",
                 schedule: str = "gpipe", split_points: Optional[Sequence[str]] = None, stages: Optional[int] = None,
                 sample: Any = None, by: str = "time", leaves: Leaves = ()) -> None:
        super().__init__()
        self._graph: Optional[GraphStages] = None
        self._stages: Union[GraphStages, ChainStages]
        if is_graph_split(module, split_points, stages):
            self._init_graph(module, balance, devices, chunks, checkpoint, schedule, split_points, stages, sample, by,
                             leaves)
            return
        if balance is None:
            raise BalanceError("give balance=[layers per group] to split an nn.Sequential (or split_points=, stages=)")
        layers = _layers(module)  # type: ignore[arg-type]
        self.plan: Split = validate_split(len(layers), balance, devices, chunks, checkpoint,
                                          available=available_devices(), canonical=canonical_device,
                                          accelerators=accelerators(), schedule=schedule)
        check_shared_layers([[layers[index] for index in r] for r in self.plan.ranges], self.plan.devices)
        self.devices = [torch.device(d) for d in self.plan.devices]
        self.partitions = nn.ModuleList(nn.Sequential(*[layers[index] for index in r]) for r in self.plan.ranges)
        self._stages = ChainStages(self.partitions, self.devices)

    def _init_graph(self, module: Any, balance: Optional[Sequence[int]], devices: Optional[Sequence[str]],
                    chunks: int, checkpoint: str, schedule: str, split_points: Optional[Sequence[str]],
                    stages: Optional[int],
                    sample: Any, by: str, leaves: Leaves) -> None:
        if not isinstance(module, nn.Module) or _one_layer(module):
            why = ", one torch.nn layer: nothing to split" if isinstance(module, nn.Module) else ""
            raise TypeError("module must be an nn.Sequential, a list of layers, or a model of several modules "
                            f"(module: {type(module).__name__}{why})")
        n = stage_count(split_points, balance, stages)
        # Devices, chunks and checkpoint are checked before the model is traced or measured.
        plan = validate_split(n, [1] * n, devices, chunks, checkpoint, available=available_devices(),
                          canonical=canonical_device, accelerators=accelerators(), schedule=schedule)
        graph = GraphStages(module, plan.devices, split_points=split_points, balance=balance, stages=stages,
                            sample=sample, by=by, leaves=leaves)
        self.plan = dataclasses.replace(plan, ranges=tuple(graph.split.stage_range(j) for j in range(n)))
        self.devices = graph.devices
        # A plain list, not registered: the stages only reference the modules adopted below.
        self.partitions = graph.modules  # type: ignore[assignment]
        self._adopt(module)
        self._graph = self._stages = graph

    def _adopt(self, module: nn.Module) -> None:
        """Register the original's own parameters, buffers and children under their own names."""
        for name in [*module._parameters, *module._buffers, *module._modules]:
            if name in self.__dict__ or hasattr(type(self), name):
                raise StrategyError(f"the model's attribute {name!r} clashes with ModelParallel.{name}; rename it")
        for name, param in module._parameters.items():
            self.register_parameter(name, param)
        for name, buffer in module._buffers.items():
            self.register_buffer(name, buffer, persistent=name not in module._non_persistent_buffers_set)
        for name, child in module._modules.items():
            self.add_module(name, child)
        self.train(module.training)

    @property
    def graph_stages(self) -> Optional[GraphStages]:
        """The captured graph, its cut and its stage modules (None for a Sequential split by layers)."""
        return self._graph

    @property
    def balance(self) -> Optional[List[int]]:
        """Layers per group (a graph: top-level units per stage; None when a cut falls inside a unit)."""
        return self.plan.balance if self._graph is None else self._graph.unit_balance()

    @property
    def split_points(self) -> List[str]:
        """Where stages 1..n-1 begin (a Sequential: the index of each group's first layer)."""
        if self._graph is not None:
            return list(self._graph.split.split_points)
        return [str(r.start) for r in self.plan.ranges[1:]]

    @property
    def chunks(self) -> int:
        """Micro-batches per mini-batch (1: no micro-batching)."""
        return self.plan.chunks

    def extra_repr(self) -> str:
        """The stages' devices and, for a graph, the cut points (shown in ``repr``)."""
        cut = f", split_points={self.split_points}" if self._graph is not None else f", balance={self.balance}"
        return f"devices={[str(d) for d in self.devices]}{cut}, chunks={self.chunks}"

    def describe(self) -> str:
        """The cut points and, per boundary, the tensors crossing it with shapes and sizes."""
        if self._graph is not None:
            return self._graph.describe()
        return "\n".join(f"  stage {j} on {d}: layers {r.start}..{r.stop - 1}"
                         for j, (r, d) in enumerate(zip(self.plan.ranges, self.plan.devices)))

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the batch through the stages (as ``chunks`` micro-batches); outputs where their stage ran."""
        self._stages.copies.sync()
        view = self._stages.view(self.training)
        values = view.captured.bind(args, kwargs)
        batch = batch_size(values)
        parts = split_inputs(values, micro_batch_sizes(batch, self.plan.chunks))
        self._begin_step(batch)
        run = self._stages.run(view, self.plan, parts, record=self.recorder(self.plan.devices), lanes=self._lanes())
        flat = unique_params(view.params, self._stages.copies.masters)
        inputs = [t for name in view.split.graph.inputs for t in tensor_leaves(values[name])]
        grad = torch.is_grad_enabled() and any(t.requires_grad for t in inputs + flat)
        try:
            if not grad:
                return view.captured.unflatten(run.forward(grad=False))
            layout = Layout(view.split.graph.inputs, view.split.graph.outputs)
            outputs = GraphFunction.apply(run, layout, *inputs, *flat)
            return view.captured.unflatten(layout.rebuild(outputs))
        finally:
            self._end_forward()

    def _lanes(self) -> List[str]:
        """The thread lane of each stage: its device (cells sharing a device run one after another)."""
        return list(self.plan.devices)

    def _begin_step(self, batch: int) -> None:
        """Hook for subclasses: a step of ``batch`` rows starts (after validation)."""

    def _end_forward(self) -> None:
        """Hook for subclasses: the forward cells of a step are done."""
