"""A process pipeline stage's optimizer: its gradients averaged (or sharded, ZeRO-1/2/3) among the stage's replicas."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from dualframe.dp.zero3 import ZERO3, check_stage_sharding
from dualframe.errors import StrategyError
from dualframe.torch.dp.shard.stage import StageShardedOptimizer

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
    """``optimizer`` wrapped to average (or shard) the stage's gradients among its replicas only.

    ``DistributedOptimizer`` on the stage's process set, counting the ``chunks`` micro-batch backwards of
    a step as one (``backward_passes_per_step`` multiplies); with a single replica, ``optimizer`` itself.
    ``shard="parameters"``: a ``StageShardedOptimizer`` the pipeline gathers once per step.
    """
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
