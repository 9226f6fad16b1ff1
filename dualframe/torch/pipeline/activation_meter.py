"""The bytes autograd keeps for backward in a process pipeline's stage (activations), and their peak."""
from __future__ import annotations

import contextlib
from typing import Any, Dict, Iterable, Iterator, List, Tuple

import torch


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

    def track(self, parameters: Iterable[torch.Tensor]) -> None:
        """Take ``parameters``' storages as the parameters' from now on (ZeRO-3 gathers them into new storage)."""
        self._parameter_storages = {p.untyped_storage().data_ptr() for p in parameters}

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
