"""Loss scaling for the Keras sharded optimizer: ``ShardedLossScaleOptimizer``, one skip decision for every rank.

``hvd.DistributedOptimizer(keras.optimizers.LossScaleOptimizer(opt), shard=...)`` (or any optimizer
with ``shard=`` under the ``mixed_float16`` policy) returns it; with ``shard="parameters"`` its
``shard_model`` and ``parameter_slices`` are the sharded optimizer's, and ``fit`` scales the loss
through it (``dp/shard/parameters.py``). The fp32 master slices of float16 or
bfloat16 variables are in ``dp/shard/slices.py``; the rules in ``dualframe.dp.precision``.
"""
from __future__ import annotations

from typing import Any, Callable, List, Optional, Sequence

import keras
from keras import ops

from dualframe.errors import StrategyError
from dualframe.tensorflow.dp.optimizer import check_wrappable, register_wrapper
from dualframe.tensorflow.dp.shard.optimizer import ShardedOptimizer
from dualframe.tensorflow.dp.wrapped_optimizer import KerasTwoNames


@keras.saving.register_keras_serializable(package="dualframe")
class ShardedLossScaleOptimizer(KerasTwoNames, keras.optimizers.LossScaleOptimizer):
    """A LossScaleOptimizer around a sharded optimizer: ranks skip overflowing steps together and keep one scale.

    The scaled gradients are reduce-scattered first; each rank counts the infs and NaNs of its slices,
    the counts are summed over the ranks (one allreduce of one number), and only when the sum is zero
    do all ranks unscale their slices, step them and allgather the weights; otherwise every rank skips
    the step and halves the scale. After ``dynamic_growth_steps`` good steps the scale doubles, as in
    Keras's LossScaleOptimizer, whose variables, ``scale_loss``, config and saving it keeps (the
    sharded optimizer saves its state in the plain optimizer's layout, so EVERY rank calls ``model.save``).

    Args:
        inner_optimizer: a :class:`ShardedOptimizer` (``hvd.DistributedOptimizer(..., shard=...)``).
        initial_scale: the first loss scale.
        dynamic_growth_steps: good steps before the scale doubles.
        name: the optimizer's name.

    Example:
        >>> keras.mixed_precision.set_dtype_policy("mixed_float16")                                # doctest: +SKIP
        >>> opt = hvd.DistributedOptimizer(keras.optimizers.Adam(1e-3), shard="gradients")          # doctest: +SKIP
        >>> type(opt).__name__                                                                      # doctest: +SKIP
        'ShardedLossScaleOptimizer'
        >>> model.compile(optimizer=opt, loss="mse"); model.fit(x, y)                               # doctest: +SKIP
    """

    def __init__(self, inner_optimizer: ShardedOptimizer, initial_scale: float = 2.0 ** 15,
                 dynamic_growth_steps: int = 2000, name: Optional[str] = None, **kwargs: Any) -> None:
        if not isinstance(inner_optimizer, ShardedOptimizer):
            raise StrategyError(f"ShardedLossScaleOptimizer wraps hvd.DistributedOptimizer(..., shard=...) (got "
                                f"{type(inner_optimizer).__name__}); for shard=None use hvd.DistributedOptimizer")
        super().__init__(inner_optimizer, initial_scale=initial_scale, dynamic_growth_steps=dynamic_growth_steps,
                         name=name or f"loss_scale_{inner_optimizer.name}", **kwargs)
        inner_optimizer._zero.guard = self._guard  # an untracked holder: no tracking cycle

    def build(self, var_list: Sequence[Any]) -> None:
        """The scale's variables; ZeRO-3 (built on the model by ``shard_model``): on the slices, inner left as is.

        Built once: a later call keeps the scale and its counter (the inner optimizer checks ``var_list``).
        """
        if self.built:
            self.inner_optimizer.build(var_list)
            return
        if self.inner_optimizer.shard != "parameters":
            super().build(var_list)
            return
        self.step_counter = self.add_variable((), "zeros", "int", name="step_counter")
        self.dynamic_scale = self.add_variable((), keras.initializers.Constant(self.initial_scale), "float32",
                                               name="dynamic_scale")
        keras.optimizers.Optimizer.build(self, self.inner_optimizer.parameter_slices())

    def shard_model(self, model: keras.Model, root_rank: int = 0) -> keras.Model:
        """ZeRO-3: the sharded optimizer's :meth:`~ShardedOptimizer.shard_model`; compile the result with this optimizer.

        Builds this optimizer too, so a traced GradientTape loop's ``scale_loss`` reads the scale variable.
        """
        sharded = self.inner_optimizer.shard_model(model, root_rank)
        self.build(self.parameter_slices())
        return sharded

    def parameter_slices(self) -> List[Any]:
        """ZeRO-3: what a GradientTape loop differentiates ``scale_loss(loss)`` by and applies to."""
        return self.inner_optimizer.parameter_slices()

    def apply(self, grads: Sequence[Any], trainable_variables: Optional[Sequence[Any]] = None) -> None:
        """Hand the scaled gradients to the sharded optimizer, which reduces them and calls back :meth:`_guard`."""
        if not self.built:
            self.build(list(trainable_variables) if trainable_variables is not None else [])
        self.inner_optimizer.apply(grads, trainable_variables)

    def _guard(self, slice_grads: List[Any], step: Callable[[List[Any]], None]) -> None:
        counts = [ops.sum(ops.cast(ops.logical_not(ops.isfinite(g)), "float32")) for g in slice_grads]
        local = ops.sum(ops.stack(counts)) if counts else ops.zeros((), "float32")
        nonfinite = self.inner_optimizer.sum_everywhere(local, "nonfinite")

        def finite() -> None:
            scale = self.dynamic_scale
            step([g / ops.cast(scale, g.dtype) for g in slice_grads])
            ops.cond(ops.equal(self.step_counter, self.dynamic_growth_steps - 1), self._grow, self._count)

        ops.cond(ops.equal(nonfinite, 0.0), finite, self._stateful_handle_non_finite_grads)

    def _grow(self) -> None:
        self.step_counter.assign(0)
        self.dynamic_scale.assign(ops.multiply(self.dynamic_scale, 2.0))

    def _count(self) -> None:
        self.step_counter.assign_add(1)


def sharded_loss_scale(optimizer: keras.optimizers.Optimizer, name: Optional[str] = None,
                       **kwargs: Any) -> ShardedLossScaleOptimizer:
    """From DistributedOptimizer's arguments with ``shard=``: keep a LossScaleOptimizer's settings, or add Keras's defaults."""
    initial_scale, growth = 2.0 ** 15, 2000
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        check_wrappable(optimizer)
        initial_scale, growth = optimizer.initial_scale, optimizer.dynamic_growth_steps
        optimizer = optimizer.inner_optimizer
    return ShardedLossScaleOptimizer(ShardedOptimizer(optimizer, **kwargs), initial_scale, growth, name=name)


register_wrapper(ShardedLossScaleOptimizer)
