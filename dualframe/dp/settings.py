"""How gradients are reduced, written once for both adapters: the checked settings and Horovod's scale factors."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Tuple


@dataclass(frozen=True)
class ReduceSettings:
    """A data-parallel reduction's settings, checked by the adapter before any communication.

    ``op`` is the core's op name (``"average"``, ``"sum"`` ...), ``compression`` a compressor
    (``dualframe.dp.compression``), ``process_set`` the adapter's Horovod process set. The torch
    ``DistributedOptimizer`` and the TensorFlow gradient reduction (tape and Keras optimizer) keep one.

    Example:
        >>> settings = ReduceSettings(compression=None, op="average", gradient_predivide_factor=4.0)
        >>> settings.scale_factors()
        (0.25, 4.0)
        >>> settings.with_passes(2).backward_passes_per_step
        2
    """

    compression: Any
    op: str
    sparse_as_dense: bool = False
    gradient_predivide_factor: float = 1.0
    process_set: Any = None
    backward_passes_per_step: int = 1

    def scale_factors(self) -> Tuple[float, float]:
        """(prescale, postscale): with ``"average"``, divide by the predivide factor before the sum and the rest after.

        Horovod's Average already divides by the number of ranks after the sum; the predivide factor
        splits that division around the sum (less overflow in fp16), as Horovod's own optimizers do.
        """
        if self.op == "average":
            return 1.0 / self.gradient_predivide_factor, self.gradient_predivide_factor
        return 1.0, 1.0

    def with_passes(self, backward_passes_per_step: int) -> "ReduceSettings":
        """The same settings accumulating ``backward_passes_per_step`` backward passes per reduction."""
        return replace(self, backward_passes_per_step=backward_passes_per_step)
