"""Horovod's torch functions (init, collectives, broadcasts of state) with their arguments checked first."""
from __future__ import annotations

import functools
import inspect
import itertools
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple, TypeVar, cast

import torch

from dualframe.collectives import ProcessSetsArg
from dualframe.errors import StrategyError
from dualframe.torch.dp import checks as dp_checks
from dualframe.torch.collectives import check_initialized, collectives, hvd
from dualframe.torch.dp.optimizer import DistributedOptimizer

F = TypeVar("F", bound=Callable[..., Any])


def init(comm: Any = None, process_sets: ProcessSetsArg = None) -> None:
    """Start Horovod (Horovod's ``init``); later calls only register new process sets (``HorovodCollectives.init``).

    Args:
        comm: an mpi4py communicator or a list of ranks, as in Horovod.
        process_sets: ``hvd.ProcessSet`` objects or rank lists to register, or ``"dynamic"``.

    Raises:
        StrategyError: a process set names a rank outside the job, before Horovod starts.
    """
    collectives.init(comm, process_sets)


def needs_init(function: F) -> F:
    """Wrap a Horovod function: refuse it before ``init()``, check ``tensor``, ``op`` and ``root_rank`` first."""
    signature = inspect.signature(function)
    calls = itertools.count()

    @functools.wraps(function)
    def checked(*args: Any, **kwargs: Any) -> Any:
        check_initialized(f"{function.__name__}()")
        binding = signature.bind_partial(*args, **kwargs)
        bound = binding.arguments
        tensor = bound.get("tensor")
        if "tensor" in bound and not isinstance(tensor, torch.Tensor):
            raise StrategyError(f"{function.__name__} needs a torch.Tensor (tensor: {type(tensor).__name__})")
        if bound.get("op") is not None:
            dp_checks.op_name(bound["op"])
        if "root_rank" in bound:
            process_set = bound.get("process_set", hvd.global_process_set)
            dp_checks.check_root_rank(bound["root_rank"], hvd.size() if process_set.process_set_id == 0 else 1 << 30)
        if "name" in signature.parameters and bound.get("name") is None:
            # Horovod names an unnamed op by its handle number, which differs between ranks once
            # one rank has run more ops (uneven data before join): count this function's calls instead.
            bound["name"] = f"dualframe.{function.__name__}.{next(calls)}"
            return function(*binding.args, **binding.kwargs)
        return function(*args, **kwargs)
    return cast(F, checked)


def _named_tensors(params: Any) -> List[Tuple[Optional[str], torch.Tensor]]:
    if isinstance(params, dict):
        pairs = sorted(params.items())
    elif isinstance(params, Iterable):
        pairs = [p if isinstance(p, tuple) else (None, p) for p in params]
    else:
        raise StrategyError(f"params must be a state_dict, named_parameters() or parameters() (params: {type(params).__name__})")
    for name, value in pairs:
        if not isinstance(value, torch.Tensor):
            raise StrategyError(f"params must hold tensors (params[{name!r}]: {type(value).__name__})")
    return pairs


def broadcast_parameters(params: Any, root_rank: int) -> None:
    """Overwrite ``params`` (a state_dict, ``named_parameters()`` or ``parameters()``) with root_rank's, in place."""
    check_initialized("broadcast_parameters()")
    dp_checks.check_root_rank(root_rank, hvd.size())
    pairs = _named_tensors(params)
    handles = [hvd.broadcast_async_(p, root_rank, name) for name, p in pairs]
    for handle in handles:
        hvd.synchronize(handle)


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int, model: Any = None) -> None:
    """Make every rank's optimizer state (and options such as ``lr``) root_rank's.

    A fresh optimizer's state is first created by one local step on zero gradients, as Horovod does;
    a DistributedOptimizer is unwrapped for that, so no reduction runs.
    """
    check_initialized("broadcast_optimizer_state()")
    dp_checks.check_root_rank(root_rank, hvd.size())
    if isinstance(optimizer, DistributedOptimizer) and optimizer.shard is not None:
        # A sharded optimizer's state lives in slices: gathered, broadcast, re-cut (no zero-gradient step).
        optimizer.broadcast_state(root_rank)  # type: ignore[attr-defined]
        return
    inner = optimizer.optimizer if isinstance(optimizer, DistributedOptimizer) else optimizer
    if not isinstance(inner, torch.optim.Optimizer):
        raise StrategyError(f"optimizer must be a torch.optim.Optimizer (optimizer: {type(optimizer).__name__})")
    from horovod.torch.functions import broadcast_optimizer_state as horovod_broadcast_state
    horovod_broadcast_state(inner, root_rank, model=model)


def broadcast_object(obj: Any, root_rank: int = 0, name: Optional[str] = None,
                     process_set: Any = hvd.global_process_set) -> Any:
    """root_rank's ``obj`` (any picklable object) on every rank."""
    check_initialized("broadcast_object()")
    dp_checks.check_root_rank(root_rank, hvd.size() if process_set.process_set_id == 0 else 1 << 30)
    return hvd.broadcast_object(obj, root_rank=root_rank, name=name, process_set=process_set)


def allgather_object(obj: Any, name: Optional[str] = None) -> List[Any]:
    """Every rank's ``obj`` (any picklable object), as a list indexed by rank."""
    check_initialized("allgather_object()")
    return cast(List[Any], hvd.allgather_object(obj, name=name))


def wrapped(names: Sequence[str]) -> Dict[str, Any]:
    """Horovod's functions of those names, each wrapped by ``needs_init``."""
    return {name: needs_init(getattr(hvd, name)) for name in names}
