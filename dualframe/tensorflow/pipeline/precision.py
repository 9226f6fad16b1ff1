"""Loss scaling in a Keras process pipeline: ``PipelineLossScaleOptimizer``, one skip decision for every rank of the pipeline.

The last stage multiplies each micro-batch's loss by the optimizer's ``dynamic_scale`` (``ScaledLoss``), so
every stage's gradients arrive scaled, as in ``keras.Model.fit`` with a ``LossScaleOptimizer``. Before the
update every rank of the pipeline (all stages, all replicas) adds its "found non-finite" flag in one Horovod
allreduce: all of them then unscale and apply, or all skip, halve the scale and reset the growth counter.
The scale and the counter are the Keras ``LossScaleOptimizer``'s variables, saved with the optimizer.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

import keras
import tensorflow as tf
from keras import ops

from dualframe.tensorflow.collectives import hvd
from dualframe.tensorflow.pipeline.losses import use_loss

if TYPE_CHECKING:
    from dualframe.tensorflow.pipeline.distributed import DistributedPipeline


@keras.saving.register_keras_serializable(package="dualframe")
class PipelineLossScaleOptimizer(keras.optimizers.LossScaleOptimizer):
    """A Keras ``LossScaleOptimizer`` whose skip decision is taken by every rank of a process pipeline together.

    ``pipe.distributed_optimizer(keras.optimizers.LossScaleOptimizer(opt))`` (or ``pipe.compile`` with one, or
    with any optimizer under the ``mixed_float16`` policy) returns it around the stage's optimizer (averaged
    among the stage's replicas), and the pipeline's last stage scales its loss by ``dynamic_scale``.

    Args:
        inner_optimizer: the stage's optimizer (``DistributedOptimizer`` on its replicas' process set, or plain).
        initial_scale, dynamic_growth_steps: Keras's (the scale doubles after that many applied steps).
        name: the optimizer's name.
        flag_name: the Horovod name of the step's "found non-finite" allreduce (the pipeline's prefix).

    Example:
        >>> pipe = hvd.DistributedPipeline(model, stages=2, chunks=4, loss_fn="mse")               # doctest: +SKIP
        >>> opt = pipe.distributed_optimizer(keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1)))  # doctest: +SKIP
        >>> loss = pipe.train_step(x, y)   # the last stage's loss scaled by opt.dynamic_scale     # doctest: +SKIP
        >>> pipe.apply_gradients(opt)      # every rank applies, or every rank skips and halves     # doctest: +SKIP
    """

    def __init__(self, inner_optimizer: keras.optimizers.Optimizer, initial_scale: float = 2.0 ** 15,
                 dynamic_growth_steps: int = 2000, name: Optional[str] = None, flag_name: str = "dpipe") -> None:
        super().__init__(inner_optimizer, initial_scale=initial_scale, dynamic_growth_steps=dynamic_growth_steps,
                         name=name or f"pipeline_loss_scale_{inner_optimizer.name}")
        self.flag_name = flag_name

    def apply(self, grads: Sequence[Any], trainable_variables: Optional[Sequence[Any]] = None) -> None:
        """Agree with every rank of the pipeline on the scaled gradients' finiteness, then unscale and apply, or skip.

        Every rank calls it once per step, a stage without variables too (``grads`` empty): the flag's allreduce
        is over all ranks.
        """
        variables = list(trainable_variables) if trainable_variables is not None else []
        if not self.built:
            self.build(variables)
        grads = list(grads)
        finite_here = bool(self.check_finite(grads)) if any(g is not None for g in grads) else True
        flags = hvd.allreduce(tf.constant(0.0 if finite_here else 1.0, tf.float32), op=hvd.Sum,
                              name=f"{self.flag_name}.loss_scale.nonfinite")
        if float(flags) > 0:
            self._stateful_handle_non_finite_grads()
            return
        scale = self.dynamic_scale
        if variables:
            self.inner_optimizer.apply([g if g is None else ops.divide(g, ops.cast(scale, g.dtype)) for g in grads],
                                       variables)
        if int(self.step_counter) == self.dynamic_growth_steps - 1:
            self.step_counter.assign(0)
            self.dynamic_scale.assign(ops.multiply(self.dynamic_scale, 2.0))
        else:
            self.step_counter.assign_add(1)

    def get_config(self) -> dict:
        return {**super().get_config(), "flag_name": self.flag_name}


class ScaledLoss:
    """The pipeline's loss multiplied by the optimizer's current ``dynamic_scale`` (read at each call, not traced once)."""

    def __init__(self, loss: Callable[[Any, Any], Any], optimizer: PipelineLossScaleOptimizer) -> None:
        self.loss, self.optimizer = loss, optimizer

    def __call__(self, targets: Any, outputs: Any) -> Any:
        value = self.loss(targets, outputs)
        return ops.multiply(ops.cast(value, "float32"), self.optimizer.dynamic_scale)


def unscaled(loss: Any) -> Any:
    """The loss a ``ScaledLoss`` wraps; any other loss as it is."""
    return loss.loss if isinstance(loss, ScaledLoss) else loss


def pipeline_loss_scale(pipe: "DistributedPipeline", optimizer: keras.optimizers.Optimizer,
                        stage: Callable[[keras.optimizers.Optimizer], Any]) -> PipelineLossScaleOptimizer:
    """``optimizer`` (a LossScaleOptimizer's settings kept, else Keras's) around ``stage(inner)``; the pipeline's loss scaled.

    Built at once: the last stage's compiled passes read ``dynamic_scale`` as a variable from their first trace.
    """
    initial_scale, growth = 2.0 ** 15, 2000
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        initial_scale, growth = optimizer.initial_scale, optimizer.dynamic_growth_steps
        optimizer = optimizer.inner_optimizer
    scaled = PipelineLossScaleOptimizer(stage(optimizer), initial_scale, growth, flag_name=pipe.role.link.prefix)
    scaled.build(pipe.trainable_variables)
    if pipe.loss_fn is not None:
        use_loss(pipe, ScaledLoss(unscaled(pipe.loss_fn), scaled))
    return scaled
