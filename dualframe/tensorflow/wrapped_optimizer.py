"""What makes the Keras DistributedOptimizer look like the optimizer it wraps: its class, its attributes, ``lr``.

Horovod's contract is that the wrapper *is* an instance of the user's optimizer class
(``isinstance(hvd.DistributedOptimizer(Adam()), keras.optimizers.Adam)``): Horovod builds, at run
time, a subclass of that class. dualframe does the same here (one class per wrapped optimizer
class, cached), with the wrapper's methods first in the method order, so that every call the
wrapper does not define reaches the wrapped optimizer's class only through the wrapper's own
explicit base-class calls, never the user's ``update_step`` or ``build``.
"""
from __future__ import annotations

from typing import Any, Dict, Tuple

import keras
from keras.src.saving import object_registration

#: (wrapper class, optimizer class) -> the class whose instances are both.
_CLASSES: Dict[Tuple[type, type], type] = {}


def optimizer_subclass(wrapper: type, optimizer_class: type) -> type:
    """A class deriving from ``wrapper`` first and ``optimizer_class`` second (made once per pair).

    It keeps the wrapper's name, module and Keras registered name, so models saved with it name the
    wrapper and load through the wrapper's ``from_config``.

    Example:
        >>> cls = optimizer_subclass(DistributedOptimizer, keras.optimizers.Adam)  # doctest: +SKIP
        >>> issubclass(cls, keras.optimizers.Adam) and issubclass(cls, DistributedOptimizer)  # doctest: +SKIP
        True
    """
    if issubclass(wrapper, optimizer_class):
        return wrapper
    key = (wrapper, optimizer_class)
    if key not in _CLASSES:
        cls = type(wrapper.__name__, (wrapper, optimizer_class), {
            "__module__": wrapper.__module__, "__qualname__": wrapper.__qualname__,
            "__doc__": wrapper.__doc__, "wrapper_class": wrapper})
        # Keras names a class in a saved file by this table (keras.saving.get_registered_name); the
        # public register_keras_serializable would also rebind the wrapper's name to this subclass.
        names = object_registration.GLOBAL_CUSTOM_NAMES
        if wrapper in names:
            names[cls] = names[wrapper]
        _CLASSES[key] = cls
    return _CLASSES[key]


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
