"""The TensorFlow backend: the one object implementing the core's ``Backend`` protocol (``dualframe.backend``)."""
from __future__ import annotations

from typing import Optional

import tensorflow as tf

from dualframe.backend import AdapterBackend
from dualframe.tensorflow.collectives import TFBatchOps, TFCaster, collectives
from dualframe.tensorflow.pipeline.link import TFWire, point_to_point, process_sets


class TFPlacement:
    """TensorFlow's device for a stage (the core's ``Placement``): the name ``tf.device`` takes, or the default.

    Example:
        >>> TFPlacement().device("/GPU:0"), TFPlacement().device(None)   # doctest: +SKIP
        ('/GPU:0', None)
    """

    def device(self, name: Optional[str]) -> Optional[str]:
        """The device name as given (``tf.device`` takes it); None keeps TensorFlow's default placement."""
        return name if name else None


#: The TensorFlow adapter's one Backend (``dualframe.backend``).
BACKEND: AdapterBackend[tf.Tensor] = AdapterBackend(
    "tensorflow", collectives, TFCaster(), TFBatchOps(), TFPlacement(), lambda device: TFWire(),
    point_to_point, process_sets, split_backward=True)
