"""``dualframe.keras``: the same module as ``dualframe.tensorflow.keras``."""
import sys

from dualframe.tensorflow import keras as _keras

sys.modules[__name__] = _keras
