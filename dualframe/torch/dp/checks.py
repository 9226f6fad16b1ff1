"""Argument checks for PyTorch data parallelism (torch-specific; shared ones are dualframe.dp.checks)."""
from __future__ import annotations

from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple, Union

import torch

from dualframe.dp import checks as core_checks
from dualframe.dp.checks import check_compression, check_root_rank
from dualframe.errors import StrategyError
from dualframe.torch.collectives import OPS, hvd

GroupsArg = Union[None, int, Sequence[Sequence[torch.Tensor]]]


def op_name(op: object) -> str:
    """The core's name (``"average"`` ...) of a Horovod op constant or op name; StrategyError if unknown."""
    return core_checks.op_name(op, OPS)


def check_numbers(backward_passes_per_step: object, op: object, gradient_predivide_factor: object) -> str:
    """Validate the numeric arguments through the core's DataParallel; return the op's core name."""
    name = op_name(op)
    core_checks.check_data_parallel(name, "none", backward_passes_per_step, gradient_predivide_factor)
    return name


def optimizer_params(optimizer: torch.optim.Optimizer) -> List[torch.Tensor]:
    """Every parameter of every param group, in order."""
    return [p for group in optimizer.param_groups for p in group["params"]]


def parameter_names(
    optimizer: torch.optim.Optimizer, named_parameters: Optional[Iterable[Tuple[str, torch.Tensor]]]
) -> Dict[torch.Tensor, str]:
    """Name every optimizer parameter (Horovod's ``allreduce.noname.i.j`` when no names are given).

    Raises:
        StrategyError: entries that are not (name, tensor) pairs, duplicate names, or optimizer
            parameters that have no name.
    """
    if named_parameters is None:
        return {p: f"allreduce.noname.{i}.{j}" for i, group in enumerate(optimizer.param_groups)
                for j, p in enumerate(group["params"])}
    pairs = list(named_parameters)
    for entry in pairs:
        if not (isinstance(entry, tuple) and len(entry) == 2 and isinstance(entry[1], torch.Tensor)):
            raise StrategyError(
                f"named_parameters must be (name, parameter) pairs such as model.named_parameters() "
                f"(got entry: {type(entry).__name__} {str(entry)[:80]})"
            )
    seen: Dict[str, int] = {}
    for name, _ in pairs:
        seen[name] = seen.get(name, 0) + 1
    duplicates = sorted(name for name, count in seen.items() if count > 1)
    if duplicates:
        raise StrategyError(f"parameter names in named_parameters must be unique (duplicates: {duplicates})")
    named = {id(p) for _, p in pairs}
    missing = [(i, tuple(p.shape)) for i, p in enumerate(optimizer_params(optimizer)) if id(p) not in named]
    if missing:
        raise StrategyError(
            f"named_parameters must name every parameter of the optimizer ({len(missing)} unnamed, "
            f"(index, shape): {missing[:5]}); pass model.named_parameters() of the model being optimized"
        )
    return {p: name for name, p in pairs}


def check_groups(groups: object, params: Sequence[torch.Tensor]) -> GroupsArg:
    """``groups`` is None, an int >= 1, or lists of optimizer parameters with each at most once (the core's rule)."""
    known = {id(p) for p in params}
    return core_checks.check_groups(
        groups, "parameter", is_member=lambda p: isinstance(p, torch.Tensor) and id(p) in known,
        describe=lambda p: f", shape {tuple(p.shape)}")  # type: ignore[attr-defined]


def check_process_set(process_set: object) -> Any:
    """A registered ``hvd.ProcessSet``."""
    if not isinstance(process_set, hvd.ProcessSet):
        raise StrategyError(f"process_set must be an hvd.ProcessSet (process_set: {process_set!r})")
    if process_set.process_set_id is None:
        raise StrategyError(
            f"process set {process_set} is not registered; declare it with hvd.init(process_sets=[...]) "
            f"or hvd.add_process_set(...) (with HOROVOD_DYNAMIC_PROCESS_SETS=1)"
        )
    return process_set


def check_adasum(process_set: Any) -> None:
    """Adasum needs the global process set and, on more than one rank, Horovod's MPI controller."""
    if process_set.process_set_id != 0:
        raise StrategyError(f"op=Adasum reduces over the global process set only (process_set: {process_set})")
    if hvd.size() > 1 and not hvd.mpi_enabled():
        raise StrategyError(
            "op=Adasum needs Horovod's MPI controller (launch with mpirun or horovodrun --mpi); this job runs "
            "on Gloo (op: Adasum)"
        )
