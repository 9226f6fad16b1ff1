"""The gradients of a torch ``DistributedOptimizer``: each reduced as soon as backward has produced it.

A parameter's post-accumulate hook starts one asynchronous Horovod allreduce of its gradient (or, with
``groups``, one grouped allreduce once every member's gradient is ready), so communication overlaps the
rest of backward; ``synchronize`` starts what is missing, waits, and writes the reduced gradients back.
A mixin of ``dualframe.torch.dp.optimizer.DistributedOptimizer``, which checks the arguments and owns
the state read here; the sharded optimizers replace it (``dualframe.torch.dp.shard.gradients``).
"""
from __future__ import annotations

from typing import Any, Dict, List, Set, Tuple, Union

import torch

from dualframe.dp.settings import ReduceSettings
from dualframe.torch.dp import checks as dp_checks
from dualframe.torch.collectives import hvd
from dualframe.torch.dp.wrapped_optimizer import weak_hook

Key = Union[torch.Tensor, Tuple[torch.Tensor, ...]]
Pending = Tuple[Any, Any]  # (Horovod handle or None while gradients still accumulate, compression ctx)


class ReducedGradients:
    """Reduces each gradient (or group) once backward has produced it; ``synchronize`` waits for them all.

    Example:
        >>> class DistributedOptimizer(ReducedGradients, WrappedOptimizer): ...   # doctest: +SKIP
    """

    # Built by DistributedOptimizer.__init__.
    _optimizer: torch.optim.Optimizer
    _names: Dict[Any, str]
    _groups: dp_checks.GroupsArg
    _compression: Any
    _delay: Dict[torch.Tensor, int]
    _handles: Dict[Key, Pending]
    _requires_update: Set[torch.Tensor]
    _p_to_group: Dict[torch.Tensor, Tuple[torch.Tensor, ...]]
    _group_counts: Dict[Tuple[torch.Tensor, ...], int]
    _hook_handles: List[Any]
    _synchronized: bool
    _elastic: bool
    _adasum: bool
    _active: bool
    settings: ReduceSettings
    op_name: str
    op: Any
    process_set: Any

    def _decide(self) -> None:
        # Adasum combines the wrapped optimizer's weight deltas, not gradients (see _adasum_step).
        many = hvd.size() > 1
        self._adasum = self.op_name == "adasum" and many
        self._active = bool(self.process_set.included()) and many and not self._adasum

    # -- the reduction's settings (``dualframe.dp.settings``), read-only ---------------------------
    @property
    def backward_passes_per_step(self) -> int:
        """Backward passes accumulated locally before one reduction (``set_backward_passes_per_step`` changes it)."""
        return self.settings.backward_passes_per_step

    @property
    def gradient_predivide_factor(self) -> float:
        """With ``Average``: the share of the division done before the sum."""
        return self.settings.gradient_predivide_factor

    @property
    def sparse_as_dense(self) -> bool:
        """Whether sparse gradients are reduced as dense tensors."""
        return self.settings.sparse_as_dense


    # -- hooks: one asynchronous reduction per gradient, as soon as it is ready ---------------
    def _track(self, params: List[torch.Tensor]) -> None:
        for p in params:
            self._delay[p] = self.backward_passes_per_step
            if (self._active or self._elastic) and p.requires_grad:
                self._requires_update.add(p)
                self._hook_handles.append(p.register_post_accumulate_grad_hook(weak_hook(self)))

    def _form_groups(self) -> None:
        params = [p for p in dp_checks.optimizer_params(self._optimizer) if p.requires_grad]
        # Every rank must fuse the same tensors in the same order: rank 0's order decides. Elastic
        # workers build their optimizer at different times, so there no collective: the model's order.
        order = [self._names[p] for p in params]
        if not self._elastic:
            order = hvd.broadcast_object(order, root_rank=0, process_set=self.process_set)
        params.sort(key=lambda p: order.index(self._names[p]))
        if isinstance(self._groups, int):
            n = min(self._groups, len(params))
            size, extra = divmod(len(params), n)
            bounds = [i * size + min(i, extra) for i in range(n + 1)]
            formed = [tuple(params[bounds[i]:bounds[i + 1]]) for i in range(n)]
        else:
            listed = [tuple(p for p in group if p.requires_grad) for group in self._groups or []]
            grouped = {id(p) for group in listed for p in group}
            formed = [g for g in listed if g] + [(p,) for p in params if id(p) not in grouped]
        for group in formed:
            self._group_counts[group] = 0
            for p in group:
                self._p_to_group[p] = group

    def _on_gradient(self, p: torch.Tensor) -> None:
        if self._elastic and not self._handles:
            self._decide()  # the first gradient of a step: the world may have grown or shrunk since
        if not self._active:
            return
        if p in self._handles and self._handles[p][0] is not None and self._delay[p] <= 0:
            raise AssertionError(
                f"gradients were computed more than backward_passes_per_step "
                f"({self.backward_passes_per_step}) times before step(); raise backward_passes_per_step "
                f"to accumulate gradients locally (parameter {self._names.get(p)})"
            )
        self._delay[p] -= 1
        if self._delay[p] > 0:
            self._handles[p] = (None, None)
            return
        if p in self._p_to_group:
            group = self._p_to_group[p]
            self._group_counts[group] += 1
            if self._group_counts[group] == len(group):
                for q in group:
                    self._handles.pop(q, None)
                self._handles[group] = self._reduce_group(group)
                self._group_counts[group] = 0
            else:
                self._handles[p] = (None, None)
            return
        self._handles[p] = self._reduce(p)

    def _reduce(self, p: torch.Tensor) -> Pending:
        if p.grad is None:
            # Another rank may have a gradient for it (a branch not taken here): send zeros.
            p.grad = torch.zeros_like(p)
        name = self._names.get(p)
        tensor = p.grad
        if tensor.is_sparse:
            if not self.sparse_as_dense:
                return hvd.sparse_allreduce_async(tensor, name=name, op=self.op, process_set=self.process_set), None
            tensor = tensor.to_dense()
        compressed, ctx = self._compression.compress(tensor)
        prescale, postscale = self.settings.scale_factors()
        handle = hvd.allreduce_async_(compressed, name=name, op=self.op, prescale_factor=prescale,
                                      postscale_factor=postscale, process_set=self.process_set)
        return handle, ctx

    def _reduce_group(self, group: Tuple[torch.Tensor, ...]) -> Pending:
        grads = []
        for p in group:
            grad = torch.zeros_like(p) if p.grad is None else p.grad
            p.grad = grad.to_dense() if grad.is_sparse else grad
            grads.append(p.grad)
        pairs = [self._compression.compress(grad) for grad in grads]
        prescale, postscale = self.settings.scale_factors()
        handle = hvd.grouped_allreduce_async_([t for t, _ in pairs], name=self._names.get(group[0]), op=self.op,
                                              prescale_factor=prescale, postscale_factor=postscale,
                                              process_set=self.process_set)
        return handle, [ctx for _, ctx in pairs]

    # -- synchronize and step ------------------------------------------------------------------
    def synchronize(self) -> None:
        """Wait for every gradient reduction (starting those not started yet); gradients are then global."""
        if not self._active:
            self._synchronized = True
            return
        started: Set[torch.Tensor] = set()
        for key in self._handles:
            started.update(key) if isinstance(key, tuple) else started.add(key)
        for p in self._requires_update - started:
            self._handles[p] = self._reduce(p)
        for key, (handle, _) in list(self._handles.items()):
            if handle is None and isinstance(key, torch.Tensor):
                self._handles[key] = self._reduce(key)
        for key, (handle, ctx) in self._handles.items():
            self._finish(key, handle, ctx)
        self._handles.clear()
        self._synchronized = True

    def _finish(self, key: Key, handle: Any, ctx: Any) -> None:
        if isinstance(key, tuple):
            for p, output, one_ctx in zip(key, hvd.synchronize(handle), ctx):
                self._delay[p] = self.backward_passes_per_step
                self._set_grad(p, output, one_ctx)
            self._group_counts[key] = 0
            return
        output = handle() if callable(handle) else hvd.synchronize(handle)
        self._delay[key] = self.backward_passes_per_step
        if key in self._p_to_group:
            self._group_counts[self._p_to_group[key]] = 0
        self._set_grad(key, output, ctx)

    def _set_grad(self, p: torch.Tensor, output: torch.Tensor, ctx: Any) -> None:
        assert p.grad is not None
        if p.grad.is_sparse:
            reduced = self._compression.decompress(output, ctx)
            p.grad.zero_().add_(reduced if reduced.is_sparse else reduced.to_sparse())
        else:
            p.grad.set_(self._compression.decompress(output, ctx))
