"""Elastic training for ``import dualframe.tensorflow as hvd`` scripts: ``hvd.elastic.run`` and the states Horovod names.

Horovod's ``horovod.tensorflow.elastic.TensorFlowKerasState(model, optimizer)`` calls
``optimizer.variables()``, a list in Keras 3. ``TensorFlowKerasState`` here is the Keras 3
``KerasState`` (``dualframe.tensorflow.keras.elastic``, which takes Horovod's
``(model, optimizer=None, **kwargs)``) under Horovod's GradientTape name: given the optimizer a
GradientTape loop applies with (the model is not compiled). ``TensorFlowState`` (a list of ``tf.Variable``)
is Horovod's own, which works on Keras 3 as it is.
"""
from __future__ import annotations

from horovod.tensorflow.elastic import TensorFlowState

from dualframe.tensorflow.keras.elastic import KerasState, run

__all__ = ["run", "TensorFlowKerasState", "TensorFlowState", "KerasState"]


class TensorFlowKerasState(KerasState):
    """A Keras model and the optimizer a custom loop applies with, committed, restored and synced as one state.

    Keyword arguments (``batch=0``) become attributes kept the same way. Without ``optimizer`` it
    uses the model's (a compiled model), as ``KerasState``.

    Example:
        >>> state = hvd.elastic.TensorFlowKerasState(model, optimizer, batch=0)   # doctest: +SKIP
        >>> @hvd.elastic.run                                                      # doctest: +SKIP
        ... def train(state):
        ...     for images, labels in dataset.skip(state.batch):
        ...         training_step(images, labels); state.batch += 1; state.commit()

    Raises:
        StrategyError: ``optimizer`` is not a Keras optimizer (or the model is not a built keras.Model).
    """

    # KerasState itself takes Horovod's (model, optimizer=None, **kwargs): this is its GradientTape name.
