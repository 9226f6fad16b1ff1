"""Keras 3 adapter (``import dualframe.tensorflow.keras as hvd``): Horovod's Keras API rebuilt on Keras 3."""
from dualframe.tensorflow import *  # noqa: F401,F403  (Horovod's keras module re-exports the TF API too)
from dualframe.tensorflow import __all__ as _tf_all
from dualframe.tensorflow.keras import callbacks
from dualframe.tensorflow.keras.callbacks import broadcast_model, verbose
from dualframe.tensorflow.keras.optimizer import DistributedLossScaleOptimizer, DistributedOptimizer
from dualframe.tensorflow.keras.saving import load_model

__all__ = list(_tf_all) + [
    "callbacks", "broadcast_model", "verbose", "DistributedOptimizer", "DistributedLossScaleOptimizer",
    "load_model",
]

# Checkpoints: rank 0 writes atomically, loads are broadcast (reliability, issue 8).
from dualframe.reliability.checkpoint import TrainingState  # noqa: E402
from dualframe.tensorflow.keras.checkpoint import CheckpointCallback, load_checkpoint, save_checkpoint  # noqa: E402

from dualframe.tensorflow.keras import elastic  # noqa: E402

__all__ += ["CheckpointCallback", "TrainingState", "load_checkpoint", "save_checkpoint", "elastic"]
