"""SyncBatchNorm: batch normalization with statistics over the global batch of all ranks (CPU and GPU)."""
from __future__ import annotations

from typing import Any, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch.nn.modules.batchnorm import _BatchNorm

from dualframe.torch.collectives import hvd


def _reduce_dims(x: torch.Tensor) -> List[int]:
    return [0] + list(range(2, x.dim()))


def _per_channel(v: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return v.view([1, -1] + [1] * (x.dim() - 2))


class _SyncBatchNormFunction(torch.autograd.Function):
    """Forward: global mean and variance from summed per-channel sums; backward: summed gradient terms."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor],
                running_mean: Optional[torch.Tensor], running_var: Optional[torch.Tensor],
                eps: float, momentum: float, process_set: Any) -> torch.Tensor:
        dims, channels = _reduce_dims(x), x.size(1)
        # Sums in float64: the variance as E[x^2] - E[x]^2 cancels badly in float32.
        xd = x.detach().to(torch.float64)
        local = torch.cat([xd.sum(dims), (xd * xd).sum(dims), xd.new_tensor([x.numel() // channels])])
        total = hvd.allreduce(local, op=hvd.Sum, name="dualframe.sync_batch_norm.stats", process_set=process_set)
        count = float(total[-1])
        mean = total[:channels] / count
        var = (total[channels:2 * channels] / count - mean * mean).clamp_min(0)
        invstd = (var + eps).rsqrt().to(x.dtype)
        mean = mean.to(x.dtype)
        if running_mean is not None and running_var is not None:
            running_mean.mul_(1 - momentum).add_(momentum * mean)
            unbiased = var * count / max(count - 1, 1)
            running_var.mul_(1 - momentum).add_(momentum * unbiased.to(x.dtype))
        out = (x - _per_channel(mean, x)) * _per_channel(invstd, x)
        if weight is not None:
            out = out * _per_channel(weight, x)
        if bias is not None:
            out = out + _per_channel(bias, x)
        ctx.save_for_backward(x, weight, mean, invstd)
        ctx.count, ctx.process_set = count, process_set
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> Tuple[Optional[torch.Tensor], ...]:
        x, weight, mean, invstd = ctx.saved_tensors
        dims, channels = _reduce_dims(x), x.size(1)
        xmu = x - _per_channel(mean, x)
        sum_dy = grad_out.sum(dims)
        sum_dy_xmu = (grad_out * xmu).sum(dims)
        # Weight and bias gradients stay local: the DistributedOptimizer averages them like any other.
        grad_weight = sum_dy_xmu * invstd if weight is not None and ctx.needs_input_grad[1] else None
        grad_bias = sum_dy if ctx.needs_input_grad[2] else None
        grad_x = None
        if ctx.needs_input_grad[0]:
            total = hvd.allreduce(torch.cat([sum_dy, sum_dy_xmu]), op=hvd.Sum,
                                  name="dualframe.sync_batch_norm.grad", process_set=ctx.process_set)
            mean_dy = _per_channel(total[:channels] / ctx.count, x)
            mean_dy_xmu = _per_channel(total[channels:] / ctx.count, x)
            scale = invstd if weight is None else invstd * weight
            grad_x = (grad_out - mean_dy - xmu * _per_channel(invstd * invstd, x) * mean_dy_xmu) * _per_channel(scale, x)
        return grad_x, grad_weight, grad_bias, None, None, None, None, None


class SyncBatchNorm(_BatchNorm):
    """Batch normalization whose training statistics cover the whole global batch across ranks.

    Works on CPU and GPU tensors (Horovod's own accepts GPU tensors only). In eval mode, or on one
    process, it is ``torch.nn.BatchNorm`` exactly.

    Args:
        num_features: channels ``C`` of an input ``(N, C, ...)``.
        eps, momentum, affine, track_running_stats: as in ``torch.nn.BatchNorm1d``.
        process_set: the ranks whose batches are normalized together.

    Example:
        >>> import dualframe.torch as hvd                    # doctest: +SKIP
        >>> hvd.init()                                       # doctest: +SKIP
        >>> layer = hvd.SyncBatchNorm(16)                    # doctest: +SKIP
        >>> y = layer(torch.randn(8, 16, 5, 5))              # doctest: +SKIP
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: Optional[float] = 0.1,
                 affine: bool = True, track_running_stats: bool = True,
                 process_set: Any = hvd.global_process_set) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats)
        self.process_set = process_set

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"SyncBatchNorm expects an input of at least 2 dimensions (N, C, ...) (got {input.dim()}D)")

    def _momentum(self) -> float:
        if self.momentum is not None:
            return float(self.momentum)
        tracked = self.num_batches_tracked
        return 1.0 / max(1, int(tracked) if tracked is not None else 1)  # cumulative moving average, as in BatchNorm

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
        synced = self.training and hvd.is_initialized() and self.process_set.size() > 1
        if not synced:
            use_batch = self.training or not self.track_running_stats
            return F.batch_norm(input, self.running_mean, self.running_var, self.weight, self.bias,
                                use_batch, self._momentum() if use_batch and self.track_running_stats else 0.0,
                                self.eps)
        return _SyncBatchNormFunction.apply(
            input, self.weight, self.bias, self.running_mean, self.running_var, self.eps,
            self._momentum(), self.process_set)
