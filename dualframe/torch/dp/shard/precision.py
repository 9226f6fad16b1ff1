"""Loss scaling for torch sharded optimizers: ``hvd.ShardedGradScaler``, torch's GradScaler deciding alike on every rank.

The fp32 master slices themselves are in ``dp/shard/buckets.py`` (``master_slice``, ``travelling``); the
rules (which dtype a slice keeps, the skip decided by a sum over the ranks) in ``dualframe.dp.precision``.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch.amp.grad_scaler import OptState

from dualframe.torch.dp.shard.optimizer import ShardedOptimizer


class ShardedGradScaler(torch.amp.GradScaler):
    """``torch.amp.GradScaler`` for ``DistributedOptimizer(..., shard=...)``: one skip decision for all ranks.

    A sharded optimizer's reduced gradients live in each rank's slices, not in ``.grad``, and a rank
    sees only its slice, so torch's scaler would check the wrong tensors and let ranks disagree.
    This one unscales the reduced slices (fp32 masters for float16/bfloat16 weights), counts the
    ranks that found an inf or NaN with one allreduce of one number, and every rank skips the step
    and backs the scale off together; after ``growth_interval`` good steps the scale grows everywhere.
    Same constructor and calls as torch's; any other optimizer is handled as torch's scaler does.

    Example:
        >>> opt = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters()), shard="gradients")  # doctest: +SKIP
        >>> scaler = hvd.ShardedGradScaler("cpu")                                                   # doctest: +SKIP
        >>> with torch.autocast("cpu", dtype=torch.float16):                                        # doctest: +SKIP
        ...     loss = loss_fn(model(x), y)
        >>> scaler.scale(loss).backward(); scaler.step(opt); scaler.update(); opt.zero_grad()      # doctest: +SKIP
    """

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Unscale the reduced slices in place and agree, across the ranks, whether any is not finite."""
        if not self._enabled or not isinstance(optimizer, ShardedOptimizer):
            super().unscale_(optimizer)
            return
        self._check_scale_growth_tracker("unscale_")
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is OptState.UNSCALED:
            raise RuntimeError("unscale_() has already been called on this optimizer since the last update().")
        if state["stage"] is OptState.STEPPED:
            raise RuntimeError("unscale_() is being called after step().")
        assert self._scale is not None
        inv_scale = self._scale.double().reciprocal().float()  # in fp64 first, as torch's scaler
        found = _unscale(optimizer.reduced_slices(), inv_scale, self._scale.device)
        state["found_inf_per_device"] = {self._scale.device: optimizer.sum_everywhere(found, "nonfinite")}
        state["stage"] = OptState.UNSCALED

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Optional[float]:
        """Unscale (unless ``unscale_`` was called), then step on every rank or on none."""
        if not self._enabled or not isinstance(optimizer, ShardedOptimizer):
            return super().step(optimizer, *args, **kwargs)
        if "closure" in kwargs:
            raise RuntimeError("Closure use is not currently supported if GradScaler is enabled.")
        self._check_scale_growth_tracker("step")
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is OptState.STEPPED:
            raise RuntimeError("step() has already been called since the last update().")
        if state["stage"] is OptState.READY:
            self.unscale_(optimizer)
        result = self._maybe_opt_step(optimizer, state, *args, **kwargs)
        state["stage"] = OptState.STEPPED
        return result


def _unscale(grads: List[torch.Tensor], inv_scale: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Multiply ``grads`` by ``inv_scale`` in place; 1.0 on ``device`` if any value is inf or NaN, else 0.0."""
    groups: Dict[Tuple[torch.device, torch.dtype], List[torch.Tensor]] = defaultdict(list)
    for g in grads:
        groups[(g.device, g.dtype)].append(g)
    found = torch.zeros((), dtype=torch.float32, device=device)
    with torch.no_grad():
        for (where, _), members in groups.items():
            here = torch.zeros((), dtype=torch.float32, device=where)
            torch._amp_foreach_non_finite_check_and_unscale_(members, here, inv_scale.to(where))
            found = torch.maximum(found, here.to(device))
    return found
