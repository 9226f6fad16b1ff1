"""A Keras process pipeline stage's optimizer: its gradients averaged (or sharded, ZeRO-1/2/3) among the stage's replicas."""
from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Tuple

import keras
import tensorflow as tf

from dualframe.dp.zero3 import ZERO3, check_stage_sharding
from dualframe.errors import StrategyError
from dualframe.tensorflow.dp.optimizer import DistributedOptimizer, wants_loss_scaling
from dualframe.tensorflow.dp.shard.optimizer import ShardedOptimizer
from dualframe.tensorflow.dp.wrapped_optimizer import optimizer_subclass
from dualframe.tensorflow.pipeline.precision import PipelineLossScaleOptimizer, pipeline_loss_scale
from dualframe.tensorflow.dp.shard.stage import StageShardedOptimizer
from dualframe.tensorflow.functions import broadcast_variables

if TYPE_CHECKING:
    from dualframe.tensorflow.pipeline.distributed import DistributedPipeline

#: ``distributed_optimizer`` arguments a stage's ``shard="parameters"`` optimizer takes (others are refused by name).
ZERO3_ARGUMENTS = ("shard", "op", "bucket_elements", "scatter", "name", "backward_passes_per_step",
                   "average_aggregated_gradients", "compression")


def check_stage_optimizer(pipe: "DistributedPipeline", optimizer: Any, shard: str, kwargs: Any) -> None:
    """Refuse, on every rank alike and before any message, what a stage's optimizer cannot do.

    Raises:
        StrategyError: a second optimizer after one with ``shard="parameters"`` (the stage's variables hold
            no values between its steps); ``shard="parameters"`` with a schedule holding several stages per
            rank, with weights several stages read (tied), with a ``LossScaleOptimizer`` (its loss is
            not scaled with this mode yet), or with arguments it does not take (``keep_gathered``, ``model``, ``groups`` ...).
    """
    if pipe.sharded is not None:
        raise StrategyError("this pipeline's stage is sharded by its shard='parameters' optimizer already (its "
                            "variables hold no values between steps); make one optimizer per pipeline")
    if shard != ZERO3:
        return
    check_stage_sharding(pipe.schedule, pipe.role.layout.virtual_stages)
    if pipe.tied.plan.tied:
        raise StrategyError(f"shard='parameters' cannot keep the copies of this model's tied weights "
                            f"({', '.join(w.key for w in pipe.tied.plan.tied)}) equal yet; use shard='gradients'")
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        raise StrategyError("shard='parameters' in a Keras pipeline stage cannot take a LossScaleOptimizer: the "
                            "pipeline's stages compute their gradients from an unscaled loss, which it would "
                            "unscale; give its inner optimizer (float16 variables step through float32 master "
                            "slices), or use the mixed_bfloat16 policy")
    if "keep_gathered" in kwargs:
        raise StrategyError("keep_gathered= has no use in a pipeline stage: with shard='parameters' its "
                            "variables stay gathered from the step's first forward to its last backward")
    if "model" in kwargs:
        raise StrategyError("model= is the stage itself in a pipeline; drop model=")
    other = sorted(k for k in kwargs if k not in ZERO3_ARGUMENTS)
    if other:
        raise StrategyError(f"shard='parameters' in a Keras pipeline stage does not take {', '.join(other)} yet "
                            f"(it takes {', '.join(ZERO3_ARGUMENTS[1:])}); leave them out, or use shard='gradients'")


def stage_optimizer(pipe: "DistributedPipeline", optimizer: keras.optimizers.Optimizer, **kwargs: Any) -> Any:
    """``optimizer`` wrapped to average (or shard) the stage's gradients among its replicas only.

    ``DistributedOptimizer`` on the stage's process set (the pipeline sums a step's micro-batches, so one
    ``apply_gradients`` per step); with a single replica, ``optimizer`` itself. ``shard="parameters"``: a
    ``StageShardedOptimizer``, built now from replica 0's values (broadcast among the stage's replicas first): from here on the stage's variables hold values only within a step.
    """
    shard = str(kwargs.get("shard") or "none").lower()
    check_stage_optimizer(pipe, optimizer, shard, kwargs)
    if shard != ZERO3 and wants_loss_scaling(optimizer):
        return pipeline_loss_scale(pipe, optimizer, lambda inner: replica_optimizer(pipe, inner, kwargs))
    if pipe.stage_process_set is None:
        return optimizer
    if shard != ZERO3:
        return DistributedOptimizer(optimizer, process_set=pipe.stage_process_set, **kwargs)
    kwargs.pop("shard")
    # the replicas cut their slices from one start, replica 0's (plain Keras ZeRO-3 broadcasts root's values first)
    broadcast_variables(pipe.trainable_variables, root_rank=pipe.stage_ranks[0], process_set=pipe.stage_process_set)
    inner = [layer for stage in pipe.layers for layer in stage.layers]
    sharded = StageShardedOptimizer(optimizer, inner, pipe.trainable_variables, pipe.stage_process_set, **kwargs)
    sharded.build(pipe.trainable_variables)  # opens the variables' shapes: passes traced before would hold the old
    pipe.sharded = sharded
    pipe.recompile()
    return sharded


def replica_optimizer(pipe: "DistributedPipeline", optimizer: keras.optimizers.Optimizer, kwargs: Any) -> Any:
    """``optimizer`` averaging (or sharding, ZeRO-1/2) among the stage's replicas, without a loss scale of its own.

    Built from the wrapper classes themselves: ``DistributedOptimizer(...)`` would add a
    ``LossScaleOptimizer`` under the ``mixed_float16`` policy, deciding among the stage's replicas only.
    """
    if pipe.stage_process_set is None:
        return optimizer
    if kwargs.get("shard") is not None:
        return ShardedOptimizer(optimizer, process_set=pipe.stage_process_set, **kwargs)
    wrapper = optimizer_subclass(DistributedOptimizer, type(optimizer))
    return wrapper(optimizer, process_set=pipe.stage_process_set, **{k: v for k, v in kwargs.items() if k != "shard"})


def apply_stage_gradients(pipe: "DistributedPipeline", optimizer: Any) -> None:
    """``optimizer.apply_gradients`` on the last step's gradients and the stage's variables.

    The stage's ``shard="parameters"`` optimizer takes every gradient (a missing one as zeros) and drops
    the step's full values; ``pipe.gradients`` is emptied first, so the summed gradients go with the update.
    """
    if isinstance(optimizer, PipelineLossScaleOptimizer):  # every rank: the finite flag's allreduce
        pairs = [(g, v) for g, v in zip(pipe.gradients, pipe.trainable_variables) if g is not None]
        optimizer.apply([g for g, _ in pairs], [v for _, v in pairs])
        return
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        raise StrategyError(f"{type(optimizer).__name__} would unscale gradients the pipeline never scaled: make it "
                            f"with pipe.distributed_optimizer(keras.optimizers.LossScaleOptimizer(opt)) (or compile), "
                            f"which scales the pipeline's loss and skips an overflowing step on every rank alike")
    if optimizer is pipe.sharded and optimizer is not None:
        gradients, pipe.gradients = pipe.gradients, []
        optimizer.apply(gradients, pipe.trainable_variables)
        return
    chosen = [(g, v) for g, v in zip(pipe.gradients, pipe.trainable_variables) if g is not None]
    compiled = compiled_apply(optimizer, pipe.trainable_variables, [v for _, v in chosen])
    if compiled is None:
        optimizer.apply_gradients(chosen)
    else:
        compiled([g for g, _ in chosen])


#: Each plain Keras optimizer's updates as ``tf.function``s, one per set of variables (dropped with the optimizer).
_COMPILED: "weakref.WeakKeyDictionary[Any, Dict[Tuple[int, ...], Callable[..., Any]]]" = weakref.WeakKeyDictionary()


def compiled_apply(optimizer: Any, variables: List[Any], chosen: List[Any]) -> Optional[Callable[[List[Any]], Any]]:
    """``optimizer.apply_gradients`` on the variables ``chosen`` as one ``tf.function`` of their gradients, or None.

    Eager, a Keras optimizer runs several ops per variable from Python (about 5 ms a step for twelve
    variables here, docs/benchmarks.md); compiled, as ``Model.fit``'s train step runs it, one call.
    Only a Keras optimizer itself (not Horovod's or dualframe's wrappers, whose reductions run outside
    a function). It is built first, eagerly, on the stage's ``variables`` (a function may not make its
    variables); the function holds ``chosen`` (variables cannot be its arguments: they would arrive as
    tensors) and is made once per set of them.

    Example:
        >>> update = compiled_apply(keras.optimizers.SGD(0.1), [v], [v])       # doctest: +SKIP
        >>> update([g])                                                      # doctest: +SKIP
    """
    if not type(optimizer).__module__.startswith("keras."):
        return None
    made = _COMPILED.setdefault(optimizer, {})
    key = tuple(id(v) for v in chosen)
    if key not in made:
        if not optimizer.built:
            optimizer.build(variables)

        def update(gradients: List[Any]) -> None:
            optimizer.apply_gradients(zip(gradients, chosen))
        made[key] = tf.function(update, reduce_retracing=True)
    return made[key]
