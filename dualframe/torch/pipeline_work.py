"""One pipeline stage's work on micro-batches in torch (the core's StageWork), and an activation meter."""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Tuple

import torch
from torch import nn

from dualframe.torch.split_backward import SplitBackward
from dualframe.torch.stage_recompute import StageRecompute


class ActivationMeter:
    """Counts the bytes autograd keeps for backward (activations), and their peak, parameters excluded.

    A tensor saved by several ops (a ReLU's output that the next Linear saves as its input) counts once.

    Example:
        >>> meter = ActivationMeter(model.parameters())            # doctest: +SKIP
        >>> with meter.counting(): loss = model(x).sum()            # doctest: +SKIP
        >>> meter.peak_bytes                                        # doctest: +SKIP
    """

    def __init__(self, parameters: Iterable[torch.Tensor]) -> None:
        self._parameter_storages = {p.untyped_storage().data_ptr() for p in parameters}
        self._held: Dict[Tuple[int, int], int] = {}  # (address, bytes) of a saved tensor -> how many saved it
        self.live_bytes = 0
        self.peak_bytes = 0

    def _add(self, key: Tuple[int, int]) -> None:
        count = self._held.get(key, 0)
        self._held[key] = count + 1
        if count == 0:
            self.live_bytes += key[1]
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)

    def _drop(self, key: Tuple[int, int]) -> None:
        self._held[key] -= 1
        if self._held[key] == 0:
            del self._held[key]
            self.live_bytes -= key[1]

    def reset_peak(self) -> None:
        """Start a new peak from what is alive now."""
        self.peak_bytes = self.live_bytes

    def _pack(self, tensor: torch.Tensor) -> Any:
        if tensor.untyped_storage().data_ptr() in self._parameter_storages:
            return tensor
        # Detached: a saved output would otherwise hold its own grad_fn, a cycle Python's collector cannot
        # see, and a graph kept with retain_graph (a split backward) would never be freed.
        return _Counted(tensor.detach(), self)

    def keep(self, tensors: Iterable[Any]) -> List[Any]:
        """Count ``tensors`` (other values skipped) while the returned handles live: what a checkpointed
        micro-batch keeps outside autograd, its stage's input, counted as activations too."""
        return [_Counted(t, self) for t in tensors if isinstance(t, torch.Tensor)]

    @staticmethod
    def _unpack(packed: Any) -> torch.Tensor:
        return packed.tensor if isinstance(packed, _Counted) else packed

    @contextlib.contextmanager
    def counting(self) -> Iterator[None]:
        """Count what autograd saves inside this block until it is freed."""
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            yield


class _Counted:
    """A saved tensor that adds its bytes to the meter while alive (once for all saved copies of it)."""

    def __init__(self, tensor: torch.Tensor, meter: ActivationMeter) -> None:
        self.tensor, self.meter = tensor, meter
        self.key = (tensor.data_ptr(), tensor.numel() * tensor.element_size())
        meter._add(self.key)

    def __del__(self) -> None:
        self.meter._drop(self.key)


class TorchStageWork:
    """Forward and backward of one stage on micro-batch i, keeping what backward needs until it runs.

    The last stage turns each output into its loss, weighted by the micro-batch's share of rows,
    so the summed gradients are those of the mini-batch's mean loss. With ``split`` (a zero-bubble
    schedule), ``backward`` computes the input's gradient only and ``weight`` the weights' later.
    A micro-batch in ``recompute`` (activation checkpointing) keeps only its input from forward to
    backward, where its forward runs again first (under a split backward its graph then lives from
    B to W).
    """

    def __init__(self, stage: nn.Module, first: bool, last: bool,
                 loss_fn: Optional[Callable[[torch.Tensor, torch.Tensor], torch.Tensor]],
                 targets: List[torch.Tensor], weights: List[float], meter: ActivationMeter,
                 split: Optional[SplitBackward] = None, recompute: Optional[StageRecompute] = None) -> None:
        self.stage, self.first, self.last, self.loss_fn = stage, first, last, loss_fn
        self.targets, self.weights, self.meter, self.split = targets, weights, meter, split
        self.recompute = recompute
        self._saved: Dict[int, Tuple[torch.Tensor, Optional[torch.Tensor]]] = {}
        self._kept: Dict[int, List[Any]] = {}  # a checkpointed micro-batch's input, counted by the meter
        self.outputs: List[torch.Tensor] = []
        self.loss_sum = 0.0

    def _train(self, i: int, x: torch.Tensor) -> torch.Tensor:
        """Micro-batch i's output (the last stage: its weighted loss), recorded for a split backward."""
        if self.split is not None:
            with self.split.recording(i):
                y = self.stage(x)
        else:
            y = self.stage(x)
        if not self.last:
            return y
        assert self.loss_fn is not None
        return self.loss_fn(y, self.targets[i]) * self.weights[i]

    def forward(self, i: int, x: torch.Tensor) -> Optional[torch.Tensor]:
        if self.loss_fn is None:
            y = self.stage(x)
            if not self.last:
                return y.detach()
            self.outputs.append(y)
            return None
        if not self.first and x.is_floating_point():
            x = x.detach().requires_grad_(True)
        if self.recompute is not None and i in self.recompute:
            y = self.recompute.forward(i, lambda: self._train(i, x))
            self._saved[i] = (x, None)  # its forward runs again in backward
            self._kept[i] = self.meter.keep([x])
        else:
            y = self._train(i, x)
            self._saved[i] = (x, y)
        if not self.last:
            return y.detach()
        self.loss_sum += float(y.detach())
        return None

    def backward(self, i: int, grad: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        x, y = self._saved.pop(i)
        self._kept.pop(i, None)
        if y is None:
            assert self.recompute is not None
            y = self.recompute.replay(i, lambda: self._train(i, x))
        if self.split is not None:
            inputs = [x] if not self.first and x.requires_grad else []
            found = self.split.input_pass(i, [y], [grad], inputs)
            return found[0] if inputs else None
        torch.autograd.backward(y, grad)
        return None if self.first else x.grad

    def weight(self, i: int) -> None:
        assert self.split is not None, "W actions come with a split backward"
        self.split.weight_pass(i)
