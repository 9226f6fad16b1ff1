"""``distribute``: apply a strategy object to a torch model and optimizer (data parallelism here)."""
from __future__ import annotations

from typing import Any, Dict, Tuple

import torch

from dualframe.errors import StrategyError
from dualframe.strategy import DataParallel
from dualframe.torch.collectives import OPS, hvd
from dualframe.torch.dp.compression import Compression
from dualframe.torch.dp.checks import check_root_rank
from dualframe.torch.functions import broadcast_optimizer_state, broadcast_parameters, init
from dualframe.torch.dp.optimizer import DistributedOptimizer


def distribute(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
               strategy: DataParallel = DataParallel(), root_rank: int = 0,
               ) -> Tuple[torch.nn.Module, DistributedOptimizer]:
    """Wrap ``optimizer`` for ``strategy`` and start every rank from root_rank's weights and state.

    Calls ``init()`` when Horovod is not running yet. The same as ``hvd.DistributedOptimizer(...)``
    followed by ``broadcast_parameters`` and ``broadcast_optimizer_state``; ``strategy.shard`` other
    than ``"none"`` gives the sharded optimizer (``DistributedOptimizer(shard=...)``, ZeRO-1/2/3; with
    ``"parameters"`` the model's weights are broadcast first, then sharded, see ``model_state_dict()``).

    Args:
        model: the model every rank holds in full.
        optimizer: a plain torch optimizer over ``model``'s parameters.
        strategy: a ``dualframe.DataParallel``.
        root_rank: the rank whose initial weights and optimizer state everyone takes.

    Returns:
        ``(model, distributed_optimizer)``.

    Raises:
        StrategyError: another kind of strategy, or an invalid model or optimizer (before communication).

    Example:
        >>> import dualframe, dualframe.torch as hvd                                            # doctest: +SKIP
        >>> model, opt = hvd.distribute(model, torch.optim.SGD(model.parameters(), lr=0.1),
        ...                             strategy=dualframe.DataParallel(shard="optimizer"))       # doctest: +SKIP
    """
    if not isinstance(strategy, DataParallel):
        raise StrategyError(
            f"dualframe.torch.distribute applies dualframe.DataParallel (strategy: {type(strategy).__name__}); "
            f"model splits and pipelines have their own modules, see docs/model_parallel.md"
        )
    if not isinstance(model, torch.nn.Module):
        raise StrategyError(f"model must be a torch.nn.Module (model: {type(model).__name__})")
    init()
    check_root_rank(root_rank, hvd.size())
    zero3 = strategy.shard == "parameters"
    extra: Dict[str, Any] = {"model": model} if zero3 else {}
    if zero3:  # the full weights are broadcast before each rank keeps its slice of them
        broadcast_parameters(model.state_dict(), root_rank=root_rank)
    wrapped = DistributedOptimizer(
        optimizer, named_parameters=model.named_parameters(),
        compression=Compression.by_name(strategy.compression),
        backward_passes_per_step=strategy.backward_passes_per_step, op=OPS[strategy.op],
        gradient_predivide_factor=strategy.gradient_predivide_factor, shard=strategy.shard,
        **extra)
    if not zero3:
        broadcast_parameters(model.state_dict(), root_rank=root_rank)
    broadcast_optimizer_state(wrapped, root_rank=root_rank)
    return model, wrapped
