"""load_model: load a Keras 3 model and hand back its optimizer wrapped in a DistributedOptimizer."""
from __future__ import annotations

from typing import Any, Dict, Optional, Sequence

import keras

from dualframe.errors import StrategyError
from dualframe.tensorflow.dp.compression import Compression
from dualframe.tensorflow.dp.optimizer import DistributedLossScaleOptimizer, DistributedOptimizer


def load_model(filepath: Any, custom_optimizers: Optional[Sequence[type]] = None,
               custom_objects: Optional[Dict[str, Any]] = None, compression: Any = Compression.none,
               legacy_opts: bool = False, **optimizer_kwargs: Any) -> keras.Model:
    """Load a ``.keras`` model; its optimizer (state restored) comes back distributed.

    A model saved with a DistributedOptimizer loads it as such; a model saved with a plain
    optimizer gets it wrapped with ``compression`` and ``optimizer_kwargs``. ``legacy_opts``
    (Horovod's: Keras 2's legacy optimizers) must stay False: Keras 3 has none.

    Raises:
        StrategyError: ``legacy_opts=True``.

    Example:
        >>> model = hvd.load_model("checkpoint.keras")   # doctest: +SKIP
        >>> model.fit(x, y)                               # gradients averaged across ranks  doctest: +SKIP
    """
    if legacy_opts:
        raise StrategyError("legacy_opts=True loads Keras 2's keras.optimizers.legacy optimizers, which Keras 3 "
                            "does not have; leave legacy_opts out")
    objects: Dict[str, Any] = {"DistributedOptimizer": DistributedOptimizer,
                               "DistributedLossScaleOptimizer": DistributedLossScaleOptimizer}
    for optimizer_class in custom_optimizers or ():
        objects[optimizer_class.__name__] = optimizer_class
    objects.update(custom_objects or {})
    model = keras.models.load_model(filepath, custom_objects=objects)
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None and not isinstance(optimizer, (DistributedOptimizer, DistributedLossScaleOptimizer)):
        model.optimizer = DistributedOptimizer(optimizer, compression=compression, **optimizer_kwargs)
        model.train_function = None  # traced with the old optimizer, if ever
    return model
