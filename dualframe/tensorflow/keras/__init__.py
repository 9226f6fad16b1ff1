"""Keras 3 adapter (``import dualframe.tensorflow.keras as hvd``): Horovod's Keras API rebuilt on Keras 3.

Only re-exports: the code lives in ``dualframe.tensorflow`` (as Horovod's ``_keras``), whose API this
module carries whole (Horovod's keras module re-exports the TF API too), plus the Keras parts below, in
the sections of ``dualframe.tensorflow``. As in Horovod, five names differ from the TF module's:
``DistributedOptimizer`` and the value collectives ``allreduce``, ``allgather``, ``broadcast``,
``reducescatter``. ``dualframe.keras`` is this same module.
"""
from dualframe.tensorflow import *  # noqa: F401,F403  (every section of the TF API)
from dualframe.tensorflow import __all__ as _tf_all

# --- Data parallelism: the optimizer wrapper, Horovod's callbacks, a saved model loaded distributed ------------
from dualframe.tensorflow.dp import callbacks
from dualframe.tensorflow.dp.callbacks import broadcast_model
from dualframe.tensorflow.dp.optimizer import (  # type: ignore[assignment]  # (the TF one, replaced)
    DistributedLossScaleOptimizer, DistributedOptimizer)
from dualframe.tensorflow.dp.saving import load_model
# Horovod's Keras collectives: value in, value out (their signatures differ from the TF module's, as in Horovod).
from dualframe.tensorflow.keras_functions import (  # type: ignore[assignment]  # (the TF ones, replaced)
    allgather, allreduce, broadcast, reducescatter)
from dualframe.tensorflow.dp.callbacks import is_version_greater_equal_than  # Horovod's helper, in its Keras API

# --- Reliability: checkpoints (rank 0 writes atomically, loads are broadcast), elastic ------------------------
from dualframe.reliability.checkpoint import TrainingState
from dualframe.tensorflow.reliability import elastic
from dualframe.tensorflow.reliability.checkpoint import CheckpointCallback, load_checkpoint, save_checkpoint

# --- Observing ---------------------------------------------------------------------------------------------------
from dualframe.tensorflow.dp.callbacks import verbose

__all__ = list(_tf_all) + [
    "callbacks", "broadcast_model", "DistributedOptimizer", "DistributedLossScaleOptimizer", "load_model",
    "CheckpointCallback", "TrainingState", "load_checkpoint", "save_checkpoint", "elastic",
    "verbose", "is_version_greater_equal_than",
]
