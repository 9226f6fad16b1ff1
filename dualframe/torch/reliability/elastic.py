"""Elastic data parallelism for torch: Horovod's elastic run loop and TorchState, through dualframe.

This module reuses ``horovod.torch.elastic`` with dualframe's DistributedOptimizer (whose
``load_state_dict`` drops reductions a lost rank left pending, and which re-decides whether to reduce
at each step under elastic Horovod, so a job that grows starts averaging); it adds argument checks and
syncs the optimizer without stepping it (a joining worker would otherwise hang). Start the script with ``horovodrun --min-np/--max-np --host-discovery-script``;
on one machine also ``--network-interfaces lo`` (``dualframe run`` adds it), and name the machine
twice in the discovery script (``localhost:1`` and ``127.0.0.1:1``): a failed worker blacklists its host.
"""
from __future__ import annotations

from typing import Any, Callable, TypeVar

import torch
from horovod.torch import elastic as _elastic
from horovod.torch.elastic.state import OptimizerStateHandler, StateHandler

from dualframe.errors import StrategyError
from dualframe.torch.functions import broadcast_object, broadcast_optimizer_state
from dualframe.torch.dp.optimizer import DistributedOptimizer

F = TypeVar("F", bound=Callable[..., Any])

ElasticSampler = _elastic.ElasticSampler


class TorchState(_elastic.TorchState):  # type: ignore[misc]
    """Model, optimizer and progress that elastic training commits, restores and syncs to new workers.

    ``commit()`` keeps a copy in memory (and checks whether hosts changed); when a worker fails,
    the survivors ``restore()`` the last commit; new or restarted workers get rank 0's with ``sync()``.
    Keyword arguments (``epoch=0, batch=0``) become attributes kept the same way.

    Example:
        >>> state = TorchState(model, optimizer, epoch=0, batch=0)   # doctest: +SKIP
        >>> @run                                                      # doctest: +SKIP
        ... def train(state):
        ...     for state.epoch in range(state.epoch, epochs): ...; state.commit()

    Raises:
        StrategyError: ``model`` is not a torch module or ``optimizer`` not a torch optimizer.
    """

    def __init__(self, model: Any = None, optimizer: Any = None, **kwargs: Any) -> None:
        if model is not None and not isinstance(model, torch.nn.Module):
            raise StrategyError(f"model must be a torch.nn.Module or None (model: {type(model).__name__})")
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise StrategyError(f"optimizer must be a torch.optim.Optimizer or None "
                                f"(optimizer: {type(optimizer).__name__})")
        # Horovod's handler saves a state_dict at construction: for a sharded optimizer that is a
        # collective a joining worker would run alone. Sharded optimizers get their own handler.
        sharded = {name: value for name, value in dict(kwargs, optimizer=optimizer).items()
                   if isinstance(value, DistributedOptimizer) and value.shard is not None}
        kwargs = {name: value for name, value in kwargs.items() if name not in sharded}
        super().__init__(model=model, optimizer=None if "optimizer" in sharded else optimizer, **kwargs)
        for name, handler in list(self._handlers.items()):
            if type(handler) is OptimizerStateHandler:
                self._handlers[name] = _OptimizerHandler(handler.value)
        for name, value in sharded.items():
            self._saved_state.pop(name, None)
            self._handlers[name] = _ShardedOptimizerHandler(value)
            object.__setattr__(self, name, value)


class _OptimizerHandler(OptimizerStateHandler):  # type: ignore[misc]
    """Horovod's optimizer handler, synced with dualframe's ``broadcast_optimizer_state``.

    A worker that joins a running job has a fresh optimizer, the others do not: Horovod's sync would
    create its state with a step of dualframe's DistributedOptimizer, an allreduce the others never
    call (a hang); dualframe's steps the wrapped optimizer, which communicates nothing.
    """

    def sync(self) -> None:
        broadcast_optimizer_state(self.value, root_rank=0)


class _ShardedOptimizerHandler(StateHandler):  # type: ignore[misc]
    """A sharded optimizer's commits: the full state gathered (commit is a collective), re-cut at each sync.

    ``save`` gathers the full state on every rank (``state_dict``), so a lost rank's slices survive;
    ``restore`` loads the last commit locally; ``sync`` (every rank, after a reset) checks that all
    ranks hold the same parameters, sends rank 0's last commit to all and re-cuts it for the new size.
    Nothing communicates at construction, where a joining worker is alone.
    """

    def __init__(self, value: Any) -> None:
        super().__init__(value)
        self._saved: Any = None

    def save(self) -> None:
        self._saved = self.value.state_dict()

    def restore(self) -> None:
        if self._saved is not None:
            self.value.load_state_dict(self._saved)

    def sync(self) -> None:
        self.value.check_same_parameters()
        # Named: Horovod names an object broadcast by its type, which differs where a rank holds None.
        if broadcast_object(self._saved is not None, root_rank=0, name="dualframe.shard.has_commit"):
            self._saved = broadcast_object(self._saved, root_rank=0, name="dualframe.shard.commit")
            self.value.load_state_dict(self._saved)
        else:  # no commit yet: nothing has been stepped that must survive; cut for the current size
            self.value.resize()


def run(func: F) -> F:
    """Decorate the training function ``func(state, ...)`` to survive workers leaving and joining.

    On a lost worker (``HorovodInternalError``) the survivors restore the last commit, re-form the
    ring and call ``func`` again; on added hosts every worker syncs from rank 0. ``func`` must not
    start with a collective (new workers sync first).

    Raises:
        StrategyError: ``func`` is not callable.
    """
    if not callable(func):
        raise StrategyError(f"run decorates a training function (got {type(func).__name__}: {func!r:.60})")
    return _elastic.run(func)  # type: ignore[no-any-return]
