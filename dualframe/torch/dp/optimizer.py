"""DistributedOptimizer: wraps a torch optimizer and reduces gradients across ranks (Horovod's semantics).

Its arguments are checked and its state built here, with ``step``, clipping, Adasum and the state
dict; how each gradient is reduced and waited for is ``dualframe.torch.dp.gradients``.
"""
from __future__ import annotations

import contextlib
import os
import warnings
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Set, Tuple

import torch

from dualframe.dp.settings import ReduceSettings
from dualframe.dp.shard import check_scatter, check_shard
from dualframe.dp.zero3 import refuse_zero3_only
from dualframe.errors import StrategyError
from dualframe.torch.dp import checks as dp_checks
from dualframe.torch.collectives import OPS, check_initialized, hvd
from dualframe.torch.dp.compression import Compression
from dualframe.torch.dp.shard.buckets import check_norm_arguments
from dualframe.dp.subclass import wrapper_subclass
from dualframe.torch.dp.gradients import Key, Pending, ReducedGradients
from dualframe.torch.dp.wrapped_optimizer import WrappedOptimizer, check_optimizer, claim


class DistributedOptimizer(ReducedGradients, WrappedOptimizer):
    """A torch optimizer whose gradients are reduced across ranks before each ``step()``.

    Every gradient starts an asynchronous Horovod allreduce as soon as backward has accumulated
    it, so communication overlaps the rest of the backward pass; ``step()`` waits for them, then
    runs the wrapped optimizer. The arguments and behaviour are those of
    ``horovod.torch.DistributedOptimizer``; ``state_dict()`` is the wrapped optimizer's.

    Args:
        optimizer: the torch optimizer to wrap; the result is an instance of its class too, as Horovod's
            (``isinstance(opt, torch.optim.SGD)``). Wrapped again, the newest wrapper reduces.
        named_parameters: ``model.named_parameters()``; names the reductions, must cover every parameter.
        compression: ``Compression.none`` or ``Compression.fp16`` (or ``"none"``/``"fp16"``).
        backward_passes_per_step: backward passes accumulated locally before one reduction.
        op: ``Average``, ``Sum``, ``Adasum``, ``Min`` or ``Max``.
        gradient_predivide_factor: with ``Average``, divide by this before the sum, the rest after.
        num_groups: deprecated spelling of an int ``groups``.
        groups: an int (that many fused groups) or lists of parameters reduced together.
        sparse_as_dense: reduce sparse gradients as dense tensors.
        process_set: the ranks to reduce over (a registered ``ProcessSet``).
        shard: None, ``"optimizer"`` (ZeRO-1: a rank keeps 1/N of the optimizer state) or ``"gradients"``
            (ZeRO-2: and 1/N of the gradients), which builds a ``dualframe.torch.dp.shard.optimizer.ShardedOptimizer``
            (``scatter=`` and ``clip_grad_norm_`` are its); ``"parameters"`` (ZeRO-3: and 1/N of the parameters,
            gathered per block in forward and backward) with ``model=``, which builds a
            ``dualframe.torch.dp.shard.parameters.ParameterShardedOptimizer``.

    Raises:
        NotInitializedError: before ``hvd.init()``.
        StrategyError: any invalid argument, before any communication.

    Example:
        >>> import dualframe.torch as hvd                                        # doctest: +SKIP
        >>> hvd.init()                                                           # doctest: +SKIP
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1 * hvd.size())       # doctest: +SKIP
        >>> opt = hvd.DistributedOptimizer(opt, model.named_parameters())        # doctest: +SKIP
        >>> loss_fn(model(x), y).backward(); opt.step()                          # doctest: +SKIP
    """

    def __new__(cls, *args: Any, shard: Optional[str] = None, **kwargs: Any) -> "DistributedOptimizer":
        if cls is DistributedOptimizer and isinstance(shard, str) and shard.lower() == "parameters":
            from dualframe.torch.dp.shard.parameters import ParameterShardedOptimizer
            return super().__new__(ParameterShardedOptimizer)
        for zero3_only in ("model", "keep_gathered"):
            if zero3_only in kwargs:
                refuse_zero3_only(zero3_only, shard)
        if cls is DistributedOptimizer and not (shard is None or str(shard).lower() == "none"):  # shard: that class
            from dualframe.torch.dp.shard.optimizer import ShardedOptimizer
            return super().__new__(ShardedOptimizer)
        check_scatter(kwargs.get("scatter"), None)  # scatter= without shard=: refused here, before anything
        optimizer = args[0] if args else kwargs.get("optimizer")
        if cls is DistributedOptimizer and isinstance(optimizer, torch.optim.Optimizer) \
                and not isinstance(optimizer, WrappedOptimizer):
            cls = wrapper_subclass(cls, type(optimizer))[0]  # an instance of the user's class, as Horovod's
        return super().__new__(cls)

    def __init__(self, optimizer: torch.optim.Optimizer,
                 named_parameters: Optional[Iterable[Tuple[str, torch.Tensor]]] = None,
                 compression: Any = Compression.none, backward_passes_per_step: int = 1,
                 op: Any = hvd.Average, gradient_predivide_factor: float = 1.0, num_groups: int = 0,
                 groups: dp_checks.GroupsArg = None, sparse_as_dense: bool = False,
                 process_set: Any = hvd.global_process_set, *, shard: Optional[str] = None,
                 scatter: Optional[str] = None) -> None:
        check_initialized("DistributedOptimizer")
        self._optimizer = check_optimizer(optimizer)
        self._compression = dp_checks.check_compression(compression, Compression)
        self.op_name = dp_checks.check_numbers(backward_passes_per_step, op, gradient_predivide_factor)
        self.op = OPS[self.op_name]
        self.shard = check_shard(shard, self.op_name)
        self._names = dp_checks.parameter_names(optimizer, named_parameters)
        if num_groups:
            warnings.warn("num_groups is deprecated; use groups", DeprecationWarning, stacklevel=2)
            groups = num_groups if groups is None else groups
        self._groups = dp_checks.check_groups(groups, dp_checks.optimizer_params(optimizer))
        self.process_set = dp_checks.check_process_set(process_set)
        if self.op_name == "adasum":
            dp_checks.check_adasum(self.process_set)
        self.settings = ReduceSettings(compression=self._compression, op=self.op_name,
                                       sparse_as_dense=bool(sparse_as_dense),
                                       gradient_predivide_factor=float(gradient_predivide_factor),
                                       process_set=self.process_set, backward_passes_per_step=backward_passes_per_step)
        self._delay: Dict[torch.Tensor, int] = {}
        self._handles: Dict[Key, Pending] = {}
        self._requires_update: Set[torch.Tensor] = set()
        self._p_to_group: Dict[torch.Tensor, Tuple[torch.Tensor, ...]] = {}
        self._group_counts: Dict[Tuple[torch.Tensor, ...], int] = {}
        self._hook_handles: List[Any] = []
        self._synchronized = self._clipped = False
        self._should_synchronize = True
        # Under elastic Horovod the world size changes at a reset: hooks stay registered and whether
        # to reduce is re-decided at each step (a job started on 1 worker must reduce once it grows).
        self._elastic = os.environ.get("HOROVOD_ELASTIC") == "1"
        self._adasum = self._active = False
        self._decide()
        claim(optimizer, self)
        self._track(dp_checks.optimizer_params(optimizer))
        if (self._active or self._elastic) and self._groups is not None:
            self._form_groups()

    def __repr__(self) -> str:
        return f"DistributedOptimizer(op={self.op_name}, {self._optimizer!r})"

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """Inside this context ``step()`` does not synchronize (after an explicit ``synchronize()``)."""
        if self._adasum:
            raise StrategyError("skip_synchronize() is not available with op=Adasum (it reduces in step())")
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def _reduce_for_step(self) -> None:
        """``synchronize()`` as ``step()`` does it, warning when the gradients were already reduced."""
        if self._synchronized:
            warnings.warn("optimizer.step() called without optimizer.skip_synchronize() context after "
                          "optimizer.synchronize(): the gradients were reduced again; step inside "
                          "`with optimizer.skip_synchronize():`",
                          stacklevel=3)
        self.synchronize()

    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:  # type: ignore[override]
        """Synchronize the gradients (unless inside ``skip_synchronize()``), then step the wrapped optimizer."""
        if self._elastic and not self._handles:
            self._decide()
        if self._adasum:
            return self._adasum_step(closure)
        if self._should_synchronize and not self._clipped:
            self._reduce_for_step()
        self._synchronized = self._clipped = False
        return self._optimizer.step(closure)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Synchronize, then ``torch.nn.utils.clip_grad_norm_`` on the reduced gradients; ``step()`` reduces no more.

        Horovod's recipe (``synchronize()``, clip, ``step()`` inside ``skip_synchronize()``) in one call,
        the same call as with ``shard=`` (where the recipe cannot work), so a script switches freely.

        Returns:
            The global norm of the reduced gradients before clipping.

        Raises:
            StrategyError: ``max_norm`` or ``norm_type`` not a number > 0, or op=Adasum (it reduces in step()).

        Example:
            >>> loss.backward(); optimizer.clip_grad_norm_(1.0); optimizer.step()   # doctest: +SKIP
        """
        check_norm_arguments(max_norm, norm_type)
        if self._adasum:
            raise StrategyError("clip_grad_norm_ is not available with op=Adasum (it reduces weight changes in step())")
        if not self._synchronized:
            self.synchronize()
        params = [p for p in dp_checks.optimizer_params(self._optimizer) if p.grad is not None]
        total = torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type)
        self._clipped = True
        return total

    def _adasum_step(self, closure: Optional[Callable[[], Any]]) -> Any:
        # Horovod's delta rule: step locally, reduce the weight change with Adasum, apply it to the start.
        params = [p for p in dp_checks.optimizer_params(self._optimizer) if p.requires_grad]
        starts = [p.detach().clone() for p in params]
        loss = self._optimizer.step(closure)
        pairs = [self._compression.compress(p.detach() - start) for p, start in zip(params, starts)]
        reduced = hvd.grouped_allreduce([t for t, _ in pairs], name="dualframe.adasum.delta", op=hvd.Adasum)
        with torch.no_grad():
            for p, start, output, (_, ctx) in zip(params, starts, reduced, pairs):
                p.copy_(start + self._compression.decompress(output, ctx))
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the gradients; refused while reductions are pending (between backward and step)."""
        if self._handles:
            raise AssertionError(
                "optimizer.zero_grad() was called after loss.backward() but before optimizer.step() or "
                "optimizer.synchronize(); that would race with the pending gradient reductions"
            )
        self._optimizer.zero_grad(set_to_none=set_to_none)

    def set_backward_passes_per_step(self, passes: int) -> None:
        """Change how many backward passes are accumulated before a reduction."""
        dp_checks.check_numbers(passes, self.op, self.gradient_predivide_factor)
        self.settings = self.settings.with_passes(passes)
        for p in self._delay:
            self._delay[p] = passes

    # -- state and param groups ----------------------------------------------------------------
    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Load into the wrapped optimizer and drop pending reductions."""
        self._handles = {}
        self._synchronized = self._clipped = False
        self._should_synchronize = True
        for p in self._delay:
            self._delay[p] = self.backward_passes_per_step
        self._optimizer.load_state_dict(state_dict)

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        """Add a param group to the wrapped optimizer; its parameters are reduced too (every rank must add it)."""
        index = len(self._optimizer.param_groups)
        self._optimizer.add_param_group(param_group)
        params = self._optimizer.param_groups[index]["params"]
        for j, p in enumerate(params):
            self._names.setdefault(p, f"allreduce.noname.{index}.{j}")
        self._track([p for p in params if p not in self._delay])
