"""What makes a wrapper look like the torch optimizer it wraps (plain or sharded ``DistributedOptimizer``).

The wrapped optimizer's param groups, state, defaults, state dict and step hooks are shared rather
than copied, so a learning-rate scheduler or a checkpoint sees the user's optimizer; the wrapper is an
instance of the user's optimizer class, as Horovod's (``dualframe.dp.subclass``); an optimizer wrapped
again is reduced by its newest wrapper; a parameter's gradient hook holds its wrapper weakly.
"""
from __future__ import annotations

import weakref
from typing import Any, Callable, Dict, List, Tuple

import torch

from dualframe.errors import StrategyError


class WrappedOptimizer(torch.optim.Optimizer):
    """The face of a wrapped torch optimizer (``self._optimizer``): its data, state dict and step hooks.

    Example:
        >>> opt = dualframe.torch.DistributedOptimizer(torch.optim.SGD(params, lr=0.1))  # doctest: +SKIP
        >>> opt.param_groups[0]["lr"] = 0.05  # the wrapped SGD's learning rate             # doctest: +SKIP
    """

    _optimizer: torch.optim.Optimizer

    @property  # type: ignore[override]
    def param_groups(self) -> List[Dict[str, Any]]:  # type: ignore[override]
        """The wrapped optimizer's param groups (changing ``lr`` here changes it there)."""
        return self._optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: List[Dict[str, Any]]) -> None:
        self._optimizer.param_groups = value

    @property  # type: ignore[override]
    def state(self) -> Any:  # type: ignore[override]
        """The wrapped optimizer's per-parameter state."""
        return self._optimizer.state

    @state.setter
    def state(self, value: Any) -> None:
        self._optimizer.state = value

    @property  # type: ignore[override]
    def defaults(self) -> Dict[str, Any]:  # type: ignore[override]
        """The wrapped optimizer's defaults."""
        return self._optimizer.defaults

    @defaults.setter
    def defaults(self, value: Dict[str, Any]) -> None:
        self._optimizer.defaults = value

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The wrapped torch optimizer."""
        return self._optimizer

    def state_dict(self) -> Dict[str, Any]:
        """The wrapped optimizer's state dict (interchangeable with an unwrapped optimizer's)."""
        return self._optimizer.state_dict()

    def register_step_pre_hook(self, hook: Callable[..., Any]) -> Any:
        """Register on the wrapped optimizer (the hook receives it)."""
        return self._optimizer.register_step_pre_hook(hook)

    def register_step_post_hook(self, hook: Callable[..., Any]) -> Any:
        """Register on the wrapped optimizer (the hook receives it)."""
        return self._optimizer.register_step_post_hook(hook)


#: optimizer -> its newest wrapper (weakly), and whether that one shards the state.
OWNERS: "weakref.WeakKeyDictionary[torch.optim.Optimizer, Tuple[weakref.ref, bool]]" = weakref.WeakKeyDictionary()


def check_optimizer(optimizer: object, sharded: bool = False) -> torch.optim.Optimizer:
    """``optimizer`` when it is a plain torch optimizer (not a wrapper, ours or Horovod's).

    As with Horovod, one optimizer may be wrapped again (a script that rebuilds its wrapper); the
    newest wrapper then reduces its gradients (``claim``). Not where a sharded wrapper is involved:
    it has re-laid the parameters out in its own buckets.

    Raises:
        StrategyError: a wrapper, not an optimizer, or a sharded wrapper on either side of a re-wrap.
    """
    if isinstance(optimizer, WrappedOptimizer) or hasattr(optimizer, "_allreduce_delay"):
        raise StrategyError(f"the optimizer is already a DistributedOptimizer ({type(optimizer).__name__}); "
                            f"wrap the plain torch optimizer once")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise StrategyError(f"optimizer must be a torch.optim.Optimizer (optimizer: {type(optimizer).__name__})")
    owner = OWNERS.get(optimizer)
    if owner is not None and owner[0]() is not None and (sharded or owner[1]):
        raise StrategyError(f"this {type(optimizer).__name__} is already wrapped by a sharded DistributedOptimizer "
                            f"(or is being sharded now): a sharded wrapper must be its optimizer's only one")
    return optimizer


def claim(optimizer: torch.optim.Optimizer, wrapper: Any, sharded: bool = False) -> None:
    """Make ``wrapper`` the one whose gradient hooks reduce ``optimizer``'s parameters (an older one stops)."""
    OWNERS[optimizer] = (weakref.ref(wrapper), sharded)


def weak_hook(wrapper: Any) -> Callable[[torch.Tensor], None]:
    # A discarded wrapper (plain or sharded) must not keep reducing: the parameter's hook holds it weakly.
    ref = weakref.ref(wrapper)

    def hook(p: torch.Tensor) -> None:
        alive = ref()
        owner = OWNERS.get(alive._optimizer) if alive is not None else None
        if alive is not None and (owner is None or owner[0]() is alive):
            alive._on_gradient(p)
    return hook
