"""Measure a torch model for ``dualframe plan`` on the ``meta`` device: no weight or activation is allocated.

The model is built under ``torch.device("meta")``; one forward pass on a meta batch records, per
top-level layer, what autograd saves for the backward pass (``saved_tensors_hooks``) and the size of
the layer's output. The result is the core's plain ``ModelProfile``.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from dualframe.plan.profile import LayerProfile, ModelProfile

#: The probe runs a batch of this many rows and divides, so BatchNorm and friends see a real batch.
PROBE_BATCH = 2


def build_on_meta(builder: Callable[[], Any]) -> Any:
    """Call ``builder`` with ``meta`` as the default device, so its weights take no memory."""
    with torch.device("meta"):
        return builder()


def top_level_layers(model: nn.Module) -> List[Tuple[str, nn.Module]]:
    """The layers a ``balance`` counts: a Sequential's children, else the model's direct children."""
    children = list(model.named_children())
    return children if children else [(type(model).__name__, model)]


def _float_elements(tensor: torch.Tensor) -> float:
    # Non-float tensors (dropout masks, pooling indices) are counted by their bytes in float32 units.
    if tensor.is_floating_point():
        return float(tensor.numel())
    return tensor.numel() * tensor.element_size() / 4.0


class _Recorder:
    """Attributes every tensor autograd saves to the top-level layer running at that moment."""

    def __init__(self, layers: int, parameters: Sequence[torch.Tensor]) -> None:
        self.current = 0
        self.saved = [0.0] * layers
        self.largest = [0.0] * layers
        self.output = [0.0] * layers
        self._parameters = {id(p) for p in parameters}
        self._seen: Dict[int, torch.Tensor] = {}  # keeps bases alive so ids stay unique

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        base = tensor._base if tensor._base is not None else tensor
        if id(base) not in self._parameters and id(base) not in self._seen:
            self._seen[id(base)] = base
            size = _float_elements(base) / PROBE_BATCH
            self.saved[self.current] += size
            self.largest[self.current] = max(self.largest[self.current], size)
        return tensor

    def hooks(self, index: int) -> Tuple[Callable[..., None], Callable[..., None]]:
        def before(module: nn.Module, args: Any) -> None:
            self.current = index

        def after(module: nn.Module, args: Any, output: Any) -> None:
            tensors = [output] if isinstance(output, torch.Tensor) else [
                t for t in (output if isinstance(output, (tuple, list)) else ()) if isinstance(t, torch.Tensor)]
            size = sum(_float_elements(t) for t in tensors) / PROBE_BATCH
            self.output[index] = size
            self.largest[index] = max(self.largest[index], size)

        return before, after


def profile_module(model: nn.Module, input_shape: Sequence[int], input_dtype: str = "float32",
                   source: str = "") -> ModelProfile:
    """Profile ``model`` (ideally on ``meta``) with one forward pass on a ``meta`` batch.

    Args:
        model: the model; its direct children are the layers a ``balance`` counts.
        input_shape: one sample's shape (without the batch dimension).
        input_dtype: ``"float32"``, or ``"int64"`` for token ids.
        source: where the model came from, for the report.

    Returns:
        The ModelProfile (per-sample activation elements, parameter counts per layer).
    """
    named = top_level_layers(model)
    recorder = _Recorder(len(named), list(model.parameters()))
    handles = []
    for index, (_, layer) in enumerate(named):
        before, after = recorder.hooks(index)
        handles += [layer.register_forward_pre_hook(before), layer.register_forward_hook(after)]
    batch = torch.zeros((PROBE_BATCH, *input_shape), dtype=getattr(torch, input_dtype), device="meta")
    model.train()
    try:
        with torch.autograd.graph.saved_tensors_hooks(recorder.pack, lambda tensor: tensor):
            model.to("meta")(batch)
    finally:
        for handle in handles:
            handle.remove()
    layers = [_layer(name, layer, recorder, index) for index, (name, layer) in enumerate(named)]
    floats = [p.dtype for p in model.parameters() if p.is_floating_point()]
    dtype = str(floats[0] if floats else torch.float32).replace("torch.", "")
    elements = float(torch.Size(input_shape).numel())
    return ModelProfile("torch", source, tuple(input_shape), layers, elements, dtype)


def _layer(name: str, layer: nn.Module, recorder: _Recorder, index: int) -> LayerProfile:
    trainable = sum(p.numel() for p in layer.parameters() if p.requires_grad)
    frozen = sum(p.numel() for p in layer.parameters() if not p.requires_grad)
    frozen += sum(b.numel() for b in layer.buffers())
    return LayerProfile(name, trainable, frozen, recorder.saved[index], recorder.output[index],
                        recorder.largest[index])


def visible_devices() -> List[Dict[str, Any]]:
    """The CUDA devices torch sees, with their memory in bytes (empty on a CPU-only machine)."""
    return [{"name": f"cuda:{i}", "memory": torch.cuda.get_device_properties(i).total_memory}
            for i in range(torch.cuda.device_count())]


def profile(target: Any, input_shape: Sequence[int], input_dtype: str = "float32",
            source: str = "") -> Optional[ModelProfile]:
    """Profile a builder (called on ``meta``) or an already built module; None if it is not torch."""
    model = build_on_meta(target) if callable(target) and not isinstance(target, nn.Module) else target
    if not isinstance(model, nn.Module):
        return None
    return profile_module(model, input_shape, input_dtype, source)
