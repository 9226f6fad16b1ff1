"""What makes the Keras DistributedOptimizer look like the optimizer it wraps: its class, its attributes, ``lr``.

Horovod's contract is that the wrapper *is* an instance of the user's optimizer class
(``isinstance(hvd.DistributedOptimizer(Adam()), keras.optimizers.Adam)``): Horovod builds, at run
time, a subclass of that class. dualframe does the same (``dualframe.dp.subclass``), with the
wrapper's methods first in the method order; the wrapper calls the Keras base's ``__init__`` and
``build`` explicitly, never the user's, and reads what the user's constructor would have set from
the wrapped optimizer.
"""
from __future__ import annotations

from typing import Any

import keras
from keras.src.saving import object_registration

from dualframe.dp.subclass import wrapper_subclass


def optimizer_subclass(wrapper: type, optimizer_class: type) -> type:
    """``dualframe.dp.subclass.wrapper_subclass`` for Keras: a new class also takes the wrapper's Keras name.

    So models saved with it name the wrapper (``dualframe>DistributedOptimizer``) and load through the
    wrapper's ``from_config``.

    Example:
        >>> cls = optimizer_subclass(DistributedOptimizer, keras.optimizers.Adam)  # doctest: +SKIP
        >>> issubclass(cls, keras.optimizers.Adam) and issubclass(cls, DistributedOptimizer)  # doctest: +SKIP
        True
    """
    cls, new = wrapper_subclass(wrapper, optimizer_class)
    # Keras names a class in a saved file by this table (keras.saving.get_registered_name); the
    # public register_keras_serializable would also rebind the wrapper's name to this subclass.
    names = object_registration.GLOBAL_CUSTOM_NAMES
    if new and wrapper in names:
        names[cls] = names[wrapper]
    return cls


class KerasTwoNames:
    """``optimizer.lr``, Keras 2's name for ``learning_rate``, on dualframe's own optimizers.

    Horovod-era scripts read and set it (``model.optimizer.lr.numpy()``,
    ``tf.keras.backend.set_value(model.optimizer.lr, rate)``); Keras 3 optimizers dropped the name.
    As in Keras 2 it is a ``tf.Variable`` (the one holding the inner optimizer's rate), which Keras 3's
    legacy ``set_value`` needs; with a schedule it is the current rate.
    """

    @property
    def lr(self) -> Any:
        rate = self.learning_rate  # type: ignore[attr-defined]
        return rate.value if isinstance(rate, keras.Variable) else rate

    @lr.setter
    def lr(self, learning_rate: Any) -> None:
        self.learning_rate = learning_rate


class InnerAttributes(KerasTwoNames):
    """Attributes of the wrapped optimizer (``inner_optimizer``) that the wrapper lacks (``opt.beta_1`` ...).

    The wrapper is an instance of the wrapped optimizer's class without having run its constructor,
    so what that constructor would have set is read from the wrapped optimizer.
    """

    def __getattr__(self, name: str) -> Any:
        # Only reached when normal lookup fails; never for the wrapper's own state.
        inner = self.__dict__.get("inner_optimizer")
        if name.startswith("_") or inner is None:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return getattr(inner, name)
