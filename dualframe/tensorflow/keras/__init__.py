"""Keras 3 adapter (``import dualframe.tensorflow.keras as hvd``): Horovod's Keras API rebuilt on Keras 3."""
from dualframe.tensorflow import *  # noqa: F401,F403  (Horovod's keras module re-exports the TF API too)
from dualframe.tensorflow import __all__ as _tf_all

__all__ = list(_tf_all)
