"""Elastic training for ``import dualframe.tensorflow as hvd`` scripts: ``hvd.elastic.run`` and the states Horovod names.

Horovod's ``horovod.tensorflow.elastic.TensorFlowKerasState(model, optimizer)`` calls
``optimizer.variables()``, a list in Keras 3. ``TensorFlowKerasState`` here is the Keras 3
``KerasState`` (``dualframe.tensorflow.keras.elastic``) given the optimizer explicitly, as a
GradientTape loop has it (the model is not compiled). ``TensorFlowState`` (a list of ``tf.Variable``)
is Horovod's own, which works on Keras 3 as it is.
"""
from __future__ import annotations

from typing import Any, List, Optional

import keras
from horovod.common.elastic import ObjectState
from horovod.tensorflow.elastic import TensorFlowState

from dualframe.errors import StrategyError
from dualframe.tensorflow.collectives import hvd
from dualframe.tensorflow.functions import broadcast_variables
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

    def __init__(self, model: keras.Model, optimizer: Optional[keras.optimizers.Optimizer] = None,
                 **kwargs: Any) -> None:
        if optimizer is not None and not isinstance(optimizer, keras.optimizers.Optimizer):
            raise StrategyError(f"optimizer must be a keras.optimizers.Optimizer (optimizer: {type(optimizer).__name__})")
        self.optimizer = optimizer
        super().__init__(model, **kwargs)

    def _variables(self) -> List[Any]:
        if self.optimizer is None:
            return super()._variables()
        if not self.optimizer.built:
            self.optimizer.build(self.model.trainable_variables)
        return list(self.model.variables) + list(self.optimizer.variables)

    def sync(self) -> None:
        """Make every worker's model and optimizer rank 0's (at the start and after workers join)."""
        if self.optimizer is None:
            super().sync()
            return
        if hvd.size() > 1:
            broadcast_variables(self._variables(), root_rank=0)
        self._save_variables()
        ObjectState.sync(self)
