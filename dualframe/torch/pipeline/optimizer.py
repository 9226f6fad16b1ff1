"""A process pipeline stage's optimizer: its gradients averaged (or sharded, ZeRO-1/2/3) among the stage's replicas.

With ZeRO-3 (``shard="parameters"``) the pipeline's step, ``state_dict`` and ``load_state_dict`` go
through the stage's ``StageShardedOptimizer`` here: gathered once per step, gathered to be read,
loaded slice by slice.
"""
from __future__ import annotations

import contextlib
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterator, Mapping, Optional

import torch
from torch.nn.modules.module import _IncompatibleKeys as IncompatibleKeys

from dualframe.dp.zero3 import ZERO3, check_stage_sharding
from dualframe.errors import StrategyError
from dualframe.torch.dp.shard.stage import StageShardedOptimizer
from dualframe.torch.pipeline.activation_meter import ActivationMeter
from dualframe.torch.split.tied import stage_part

if TYPE_CHECKING:
    from dualframe.torch.pipeline.distributed import DistributedPipeline


def check_stage_optimizer(pipe: "DistributedPipeline", shard: str, kwargs: Any) -> None:
    """Refuse, on every rank alike and before any message, what a stage's optimizer cannot do.

    Raises:
        StrategyError: ``shard=`` with tied weights; ``shard="parameters"`` with a schedule holding several
            stages per rank, or with ``model=`` (the stage is the model); a second optimizer after one with
            ``shard="parameters"`` (the stage's parameters hold no values between its steps).
    """
    if pipe.sharded is not None:
        raise StrategyError("this pipeline's stage is sharded by its shard='parameters' optimizer already (its "
                            "parameters hold no values between steps); make one optimizer per pipeline")
    if pipe.tied.plan.tied and shard != "none":
        raise StrategyError(f"shard={kwargs['shard']!r} cannot keep the copies of this model's tied weights "
                            f"({', '.join(w.key for w in pipe.tied.plan.tied)}) equal yet; leave shard out")
    if shard == ZERO3:
        check_stage_sharding(pipe.schedule, pipe.role.layout.virtual_stages)
        if "model" in kwargs:
            raise StrategyError("model= is the stage itself in a pipeline (pipe.stage); drop model=")


def stage_optimizer(pipe: "DistributedPipeline", optimizer: torch.optim.Optimizer,
                    **kwargs: Any) -> torch.optim.Optimizer:
    """``optimizer`` wrapped for the stage's replicas: ``DistributedPipeline.distributed_optimizer``'s work."""
    shard = str(kwargs.get("shard") or "none").lower()
    check_stage_optimizer(pipe, shard, kwargs)
    if pipe.stage_process_set is None:
        return optimizer
    pipe.tied.before_step(optimizer)  # after the replicas' average, before the update
    passes = pipe.chunks * kwargs.pop("backward_passes_per_step", 1)
    if shard == ZERO3:
        kwargs.pop("shard")
        sharded = StageShardedOptimizer(optimizer, pipe.named_parameters(), model=pipe.stage,
                                        process_set=pipe.stage_process_set, backward_passes_per_step=passes, **kwargs)
        pipe.sharded = sharded
        return sharded
    from dualframe.torch.dp.optimizer import DistributedOptimizer
    return DistributedOptimizer(optimizer, named_parameters=pipe.named_parameters(), backward_passes_per_step=passes,
                                process_set=pipe.stage_process_set, **kwargs)


@contextlib.contextmanager
def sharded_step(sharded: Optional[StageShardedOptimizer], stage: torch.nn.Module, meter: ActivationMeter,
                 train: bool, wait: bool) -> Iterator[None]:
    """Around a pipeline step: a ZeRO-3 stage gathered first (``wait``: every block now) and, after inference, freed."""
    if sharded is None:
        yield
        return
    # Every block's allgather started: a chain's layers wait each for its own at its first forward; a graph
    # stage's nodes may read a module's weights without calling it, so it waits for all now (wait=True).
    sharded.begin_step(wait=wait)
    meter.track(stage.parameters())  # gathered into new storage: not activations
    yield
    if not train:
        sharded.end_forward()


def gathered_state_dict(sharded: StageShardedOptimizer, read: Callable[[], Dict[str, Any]]) -> Dict[str, Any]:
    """``read()`` (the stage's state dict) with the stage gathered, copied out; every replica of the stage calls it."""
    with sharded.gathered():
        return OrderedDict((key, value.detach().clone() if isinstance(value, torch.Tensor) else value)
                           for key, value in read().items())


def load_sharded_state_dict(sharded: StageShardedOptimizer, stage: torch.nn.Module, names: Any,
                            state_dict: Mapping[str, Any]) -> Any:
    """The stage's part of the model's ``state_dict`` into its replica's slices of the full tensors (no message)."""
    with sharded.listing():
        part = stage_part(stage, names, state_dict)
    sharded.load_model_state_dict(part)
    return IncompatibleKeys([], [])
