"""A torch sharded optimizer's buckets: flat buffers whose views are the parameters, this rank's slice (or its fp32 master), the element-wise rule, clipping slices.

``dualframe.torch.dp.shard.optimizer`` reduces and gathers these buckets; the layout itself (which slice
each rank owns) is the core's ``dualframe.dp.shard.ShardLayout``.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field
import math
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from dualframe.dp.precision import SlicePrecision
from dualframe.dp.shard import Bucket
from dualframe.errors import StrategyError

#: Optimizers whose update of an element reads only that element's parameter, gradient and state
#: (plus scalars such as the step count): a slice of the flat parameters steps exactly as the whole.
ELEMENTWISE = tuple(getattr(torch.optim, name) for name in (
    "SGD", "Adam", "AdamW", "Adamax", "Adagrad", "Adadelta", "RMSprop", "Rprop", "NAdam", "RAdam", "ASGD")
    if hasattr(torch.optim, name))


def check_elementwise(optimizer: torch.optim.Optimizer) -> None:
    """Refuse optimizers whose update of an element depends on other elements (the rule of sharding).

    Allowed: the built-in element-wise classes (``ELEMENTWISE``), or a class that declares
    ``dualframe_elementwise = True``. Refused: LBFGS (a line search over all parameters, closures),
    Adafactor (row and column statistics of each matrix), Muon (orthogonalizes each matrix),
    SparseAdam (sparse gradients), and any other class, including subclasses of allowed ones, whose
    ``step`` could read whole tensors (norms, trust ratios as in LAMB/LARS).
    """
    cls = type(optimizer)
    if cls in ELEMENTWISE or getattr(cls, "dualframe_elementwise", False) is True:
        return
    raise StrategyError(
        f"shard= needs an element-wise optimizer, whose update of an element reads only that element's "
        f"parameter, gradient and state ({cls.__name__} is not known to be one; allowed: "
        f"{', '.join(c.__name__ for c in ELEMENTWISE)}). LBFGS, Adafactor, Muon, LAMB/LARS read whole "
        f"tensors; use shard=None, or set {cls.__name__}.dualframe_elementwise = True if its update is element-wise"
    )


@dataclass(eq=False)
class Slot:
    """One bucket at run time: its parameters, stored as views of one flat buffer, and the rank's slice of it.

    ``flat`` (the inner optimizer's parameter) is a view of ``buffer``: stepping it updates this
    rank's part of the model's parameters in place, with no copy of the slice to keep in sync. For
    float16/bfloat16 parameters (``precision.has_master``) ``flat`` is instead an fp32 master copy of
    the slice, and the updated master is cast down and allgathered into ``buffer`` (:func:`travelling`).
    """

    name: str
    bucket: Bucket
    params: List[torch.Tensor]  # the param group's trainable parameters (the layout's tensor list)
    buffer: torch.Tensor  # the bucket's padded flat buffer; its parameters are views of it
    flat: torch.nn.Parameter
    start: int  # this rank's first element in the padded flat buffer
    ready: int = 0
    pending: Optional[Tuple[Any, Any, torch.Tensor]] = None  # (handle, compression context, send buffer)
    done: bool = False
    order: int = 0  # when its reduce-scatter was started
    members: List[torch.Tensor] = field(default_factory=list)
    precision: Optional[SlicePrecision] = None  # None: the slice is stepped in the parameters' dtype
    seen: int = -1  # the buffer's version counter when the master slice last matched it

    def gather_into(self, values: torch.Tensor, out: Dict[torch.Tensor, torch.Tensor]) -> None:
        """Cut a padded flat buffer back into one tensor per parameter of the bucket."""
        for t, offset, size in zip(self.bucket.tensors, self.bucket.offsets, self.bucket.sizes):
            p = self.params[t]
            out[p] = values[offset:offset + size].view_as(p)

    def refresh_master(self) -> None:
        """Copy the weights into the fp32 master slice if they were set since the last step (loaded, broadcast)."""
        if self.precision is not None and self.precision.has_master and self.buffer._version != self.seen:
            with torch.no_grad():
                self.flat.copy_(self.buffer[self.start:self.start + self.bucket.shard])
        self.seen = self.buffer._version

    def check_views(self) -> None:
        """Refuse parameters that no longer live in the buffer (moved or re-assigned after wrapping)."""
        for p, offset in zip(self.members, self.bucket.offsets):
            if p.data_ptr() != self.buffer[offset:].data_ptr():
                raise StrategyError(
                    f"a parameter of a sharded optimizer was moved or re-assigned after wrapping (shape "
                    f"{tuple(p.shape)}, e.g. by model.to(...) or p.data = ...); move the model first, then wrap")


def adopt(params: List[torch.Tensor], bucket: Bucket) -> torch.Tensor:
    """Copy a bucket's parameters into one padded flat buffer and make each parameter a view of it."""
    first = params[0]
    buffer = torch.zeros(bucket.padded, dtype=first.dtype, device=first.device)
    with torch.no_grad():
        for p, offset, size in zip(params, bucket.offsets, bucket.sizes):
            buffer[offset:offset + size].copy_(p.detach().reshape(-1))
            p.data = buffer[offset:offset + size].view_as(p)
    return buffer


#: The dtypes Horovod's torch collectives sum and move (no bfloat16: dualframe.dp.precision works around it).
CARRIED = ("float16", "float32", "float64", "int16", "int32", "int64", "uint8", "int8")


def dtype_name(dtype: torch.dtype) -> str:
    """``"bfloat16"`` for ``torch.bfloat16``: the core's dtype names."""
    return str(dtype).replace("torch.", "")


def precision_of(dtype: torch.dtype) -> SlicePrecision:
    """The core's dtypes (master, reduce, gather) for parameters of ``dtype`` under Horovod's torch collectives."""
    return SlicePrecision.of(dtype_name(dtype), CARRIED)


def master_slice(view: torch.Tensor, precision: SlicePrecision) -> torch.nn.Parameter:
    """The inner optimizer's parameter for a slice: the view itself, or its fp32 master copy for float16/bfloat16."""
    if not precision.has_master:
        return torch.nn.Parameter(view)  # a view: shares the buffer
    return torch.nn.Parameter(view.detach().to(getattr(torch, precision.master)))


def travelling(flat: torch.Tensor, precision: Optional[SlicePrecision]) -> torch.Tensor:
    """The updated slice as allgathered: cast down to the model's dtype, and as same-width ints if Horovod lacks it."""
    out = flat.detach()
    if precision is None or not precision.has_master:
        return out
    out = out.to(getattr(torch, precision.model))
    return out if precision.gather == precision.model else out.view(getattr(torch, precision.gather))


def arrived(gathered: torch.Tensor, precision: Optional[SlicePrecision]) -> torch.Tensor:
    """The allgathered slices back in the model's dtype (the same bits when they travelled as ints)."""
    if precision is None or precision.gather == precision.model:
        return gathered
    return gathered.view(getattr(torch, precision.model))


def make_inner(cls: type, groups: List[Dict[str, Any]], defaults: Dict[str, Any]) -> torch.optim.Optimizer:
    # Same class, same hyperparameters: the defaults the constructor accepts, the groups' own values.
    accepted = inspect.signature(cls).parameters
    kwargs = {k: v for k, v in defaults.items() if k in accepted and k != "params"}
    return cls(groups, **kwargs)  # type: ignore[no-any-return]


def check_norm_arguments(max_norm: object, norm_type: object) -> None:
    """``clip_grad_norm_``'s arguments must be numbers > 0 (``norm_type`` may be ``inf``)."""
    for name, value in (("max_norm", max_norm), ("norm_type", norm_type)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise StrategyError(f"{name} must be a number > 0 ({name}: {value!r})")


def clip_slices_(grads: Sequence[torch.Tensor], max_norm: float, norm_type: float,
                 reduce: Callable[[torch.Tensor, str], torch.Tensor]) -> torch.Tensor:
    """Scale the slices' gradients as ``torch.nn.utils.clip_grad_norm_`` scales whole ones; the global norm.

    Each rank's slices are disjoint parts of the reduced gradients (the padding's gradient is zero),
    so the global p-norm is the p-th root of the ranks' summed ``sum |g|^p`` (``reduce(local, "sum")``),
    the inf-norm the ranks' max (``reduce(local, "max")``); summed in float64, returned in float32.
    """
    infinite = math.isinf(norm_type)
    local = torch.zeros((), dtype=torch.float64)
    for g in grads:
        g64 = g.detach().to(torch.float64).abs()
        local = torch.maximum(local, g64.max().cpu()) if infinite else local + g64.pow(norm_type).sum().cpu()
    total = reduce(local, "max" if infinite else "sum")
    total = (total if infinite else total.pow(1.0 / float(norm_type))).to(torch.float32)
    coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)  # torch's own rule, 1e-6 included
    for g in grads:
        g.mul_(coefficient.to(device=g.device, dtype=g.dtype))
    return total
