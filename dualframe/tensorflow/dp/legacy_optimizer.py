"""``dualframe.tensorflow.DistributedOptimizer``: Horovod's TF entry point, for Keras 3 and TF 1 optimizers alike."""
from __future__ import annotations

from typing import Any, Optional

import keras
import tensorflow as tf

from dualframe.tensorflow.collectives import check_initialized, hvd
from dualframe.tensorflow.dp.compression import Compression


def DistributedOptimizer(optimizer: Any, name: Optional[str] = None, use_locking: bool = False,
                         device_dense: str = "", device_sparse: str = "", compression: Any = Compression.none,
                         sparse_as_dense: bool = False, backward_passes_per_step: int = 1, op: Any = hvd.Average,
                         gradient_predivide_factor: float = 1.0, average_aggregated_gradients: bool = False,
                         num_groups: int = 0, groups: Any = None, process_set: Any = hvd.global_process_set,
                         scale_local_gradients: bool = True) -> Any:
    """Wrap ``optimizer`` so that its gradients are averaged over the ranks (``horovod.tensorflow``'s signature).

    A Keras 3 optimizer gets ``dualframe.tensorflow.keras.DistributedOptimizer`` (an instance of the
    optimizer's class, as Horovod's; ``use_locking`` has no meaning there). A TF 1
    ``tf.compat.v1.train.Optimizer`` (graph mode) gets Horovod's own wrapper, unchanged.

    Example:
        >>> opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.01 * hvd.size()))  # doctest: +SKIP
        >>> isinstance(opt, keras.optimizers.SGD)                                    # doctest: +SKIP
        True

    Raises:
        NotInitializedError: before ``init()``.
        TypeError: neither a Keras 3 nor a TF 1 optimizer.
    """
    check_initialized("DistributedOptimizer")
    if isinstance(optimizer, keras.optimizers.Optimizer):
        from dualframe.tensorflow.dp.optimizer import DistributedOptimizer as KerasDistributedOptimizer

        return KerasDistributedOptimizer(
            optimizer, name=name, device_dense=device_dense, device_sparse=device_sparse, compression=compression,
            sparse_as_dense=sparse_as_dense, gradient_predivide_factor=gradient_predivide_factor, op=op,
            backward_passes_per_step=backward_passes_per_step,
            average_aggregated_gradients=average_aggregated_gradients, num_groups=num_groups, groups=groups,
            process_set=process_set, scale_local_gradients=scale_local_gradients)
    if isinstance(optimizer, tf.compat.v1.train.Optimizer):
        return hvd.DistributedOptimizer(
            optimizer, name=name, use_locking=use_locking, device_dense=device_dense, device_sparse=device_sparse,
            compression=_horovod_compression(compression), sparse_as_dense=sparse_as_dense,
            backward_passes_per_step=backward_passes_per_step, op=op,
            gradient_predivide_factor=gradient_predivide_factor,
            average_aggregated_gradients=average_aggregated_gradients, num_groups=num_groups, groups=groups,
            process_set=process_set, scale_local_gradients=scale_local_gradients)
    raise TypeError(f"DistributedOptimizer wraps a keras.optimizers.Optimizer or a tf.compat.v1.train.Optimizer "
                    f"(got {type(optimizer).__name__})")


def _horovod_compression(compression: Any) -> Any:
    """Horovod's compressor for dualframe's (or Horovod's own, passed through)."""
    if compression is Compression.none:
        return hvd.Compression.none
    if compression is Compression.fp16:
        return hvd.Compression.fp16
    return compression
