"""BatchNorm whose running statistics cover the whole mini-batch, not each micro-batch (as torchgpipe)."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm


class DeferredBatchNorm(_BatchNorm):
    """Normalises each micro-batch with its own statistics, but updates ``running_mean`` and
    ``running_var`` once per mini-batch, from all its rows, as the unsplit model's BatchNorm would.

    Outside a pipeline step it is a plain BatchNorm. During a step the pipeline calls ``begin()``
    before the first micro-batch and ``commit()`` after the last forward; calls in between add to the
    sums, and the recomputations of checkpointed micro-batches (after ``commit``) add nothing.

    Example:
        >>> pipe = dualframe.torch.Pipeline(model, [2, 2], chunks=4, deferred_batch_norm=True)  # doctest: +SKIP
        >>> isinstance(pipe.partitions[0][1], DeferredBatchNorm)                                # doctest: +SKIP
        True
    """

    def begin(self) -> None:
        """Start summing the statistics of a new mini-batch."""
        self._phase = "open"
        self._sum: Optional[torch.Tensor] = None
        self._squares: Optional[torch.Tensor] = None
        self._count = 0

    def end(self) -> None:
        """Back to plain BatchNorm behaviour (after the step's backward)."""
        self._phase = "idle"

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        phase = getattr(self, "_phase", "idle")
        if not self.training or phase == "idle":
            return super().forward(input)
        if phase == "open":
            self._add(input)
        return F.batch_norm(input, None, None, self.weight, self.bias, True, 0.0, self.eps)

    def _add(self, input: torch.Tensor) -> None:
        dims = [d for d in range(input.dim()) if d != 1]
        with torch.no_grad():
            x = input.detach().double()
            total, squares = x.sum(dims), (x * x).sum(dims)
        self._sum = total if self._sum is None else self._sum + total
        self._squares = squares if self._squares is None else self._squares + squares
        self._count += input.numel() // input.shape[1]

    def commit(self) -> None:
        """Fold the mini-batch's mean and unbiased variance into the running statistics."""
        if getattr(self, "_phase", "idle") != "open":
            return
        self._phase = "closed"
        if self._sum is None or not self.track_running_stats or self.running_mean is None:
            return
        assert self._squares is not None and self.running_var is not None
        count = self._count
        mean = self._sum / count
        var = (self._squares / count - mean * mean) * (count / max(count - 1, 1))
        assert self.num_batches_tracked is not None
        self.num_batches_tracked.add_(1)
        factor = (1.0 / float(self.num_batches_tracked)) if self.momentum is None else self.momentum
        with torch.no_grad():
            self.running_mean.mul_(1 - factor).add_(mean.to(self.running_mean.dtype), alpha=factor)
            self.running_var.mul_(1 - factor).add_(var.to(self.running_var.dtype), alpha=factor)

    @classmethod
    def convert(cls, module: nn.Module) -> nn.Module:
        """Return ``module`` with every BatchNorm1d/2d/3d (recursively) replaced by a DeferredBatchNorm
        holding the same parameters and buffers."""
        if isinstance(module, _BatchNorm) and not isinstance(module, cls):
            like = next((t for t in module.state_dict().values() if t.is_floating_point()), torch.empty(0))
            deferred = cls(module.num_features, module.eps, module.momentum, module.affine, module.track_running_stats,
                           device=like.device, dtype=like.dtype)
            deferred.load_state_dict(module.state_dict())
            return deferred.train(module.training)
        for name, child in module.named_children():
            module.add_module(name, cls.convert(child))
        return module

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")
