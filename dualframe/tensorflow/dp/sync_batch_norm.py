"""SyncBatchNormalization: a Keras 3 BatchNormalization whose batch statistics span all ranks."""
from __future__ import annotations

from typing import Any, List, Optional

import keras
import tensorflow as tf
from keras import ops

from dualframe.tensorflow.collectives import check_initialized, hvd


@keras.saving.register_keras_serializable(package="dualframe")
class SyncBatchNormalization(keras.layers.BatchNormalization):
    """Batch normalization with mean and variance taken over the whole global batch while training.

    One allreduce per layer and step carries the per-channel sums (shifted by the moving mean, so
    the variance does not lose precision). Outside training, or with one process, it is Keras's
    BatchNormalization. Horovod's version passes ``fused``, which Keras 3 removed; here ``fused``
    is accepted and ignored.

    Example:
        >>> model = keras.Sequential([keras.layers.Dense(8),                  # doctest: +SKIP
        ...                           hvd.SyncBatchNormalization(), keras.layers.ReLU()])
    """

    def __init__(self, fused: Optional[bool] = False, **kwargs: Any) -> None:
        if kwargs.get("renorm"):
            raise ValueError("SyncBatchNormalization does not support renorm=True (renorm: True)")
        super().__init__(**kwargs)

    def call(self, inputs: Any, training: Optional[bool] = None, mask: Any = None) -> Any:
        check_initialized("SyncBatchNormalization")
        if not (training and self.trainable) or hvd.size() == 1:
            return super().call(inputs, training=training, mask=mask)
        x = ops.cast(inputs, keras.backend.result_type(inputs.dtype, "float32"))
        mean, variance = self._global_moments(x, mask)
        self.moving_mean.assign(self.moving_mean * self.momentum + mean * (1.0 - self.momentum))
        self.moving_variance.assign(self.moving_variance * self.momentum + variance * (1.0 - self.momentum))
        outputs = ops.batch_normalization(
            x, mean, variance, axis=self.axis, epsilon=self.epsilon,
            offset=ops.cast(self.beta, x.dtype) if self.center else None,
            scale=ops.cast(self.gamma, x.dtype) if self.scale else None,
        )
        return ops.cast(outputs, self.compute_dtype)

    def _global_moments(self, x: Any, mask: Any) -> "tuple[Any, Any]":
        ndim = len(x.shape)
        axis = self.axis % ndim
        axes: List[int] = [i for i in range(ndim) if i != axis]
        shape = [-1 if i == axis else 1 for i in range(ndim)]
        # Sums are taken around the moving mean (equal on every rank) so E[x^2] - E[x]^2 stays precise.
        shift = tf.stop_gradient(ops.cast(self.moving_mean, x.dtype))
        centered = x - ops.reshape(shift, shape)
        if mask is None:
            weights = ops.ones_like(x)
        else:
            weights = ops.broadcast_to(ops.expand_dims(ops.cast(mask, x.dtype), axis=-1), ops.shape(x))
        local = ops.concatenate([ops.sum(centered * weights, axis=axes),
                                 ops.sum(centered * centered * weights, axis=axes), ops.sum(weights, axis=axes)])
        total = hvd.allreduce(local, op=hvd.Sum)
        channels = shift.shape[0]
        count = ops.maximum(total[2 * channels:], 1.0)
        shifted_mean = total[:channels] / count
        variance = ops.maximum(total[channels:2 * channels] / count - shifted_mean * shifted_mean, 0.0)
        return shift + shifted_mean, variance
