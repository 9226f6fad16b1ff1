"""A wrapper class that is also the wrapped object's class (Horovod's ``isinstance`` contract), made once per pair."""
from __future__ import annotations

from typing import Dict, Tuple

#: (wrapper class, wrapped object's class) -> the class deriving from both.
_CLASSES: Dict[Tuple[type, type], type] = {}


def wrapper_subclass(wrapper: type, wrapped_class: type) -> Tuple[type, bool]:
    """A class deriving from ``wrapper`` first and ``wrapped_class`` second, and whether it is new.

    Horovod's ``DistributedOptimizer`` returns an instance of a subclass of the user's optimizer
    class, so ``isinstance(opt, torch.optim.SGD)`` or ``isinstance(opt, keras.optimizers.Adam)``
    holds; user code relies on it. The class keeps the wrapper's name and module (what users and
    saved files see) and names the wrapper as ``wrapper_class``. The wrapper's methods come first:
    it must call its framework base's ``__init__``/``build`` explicitly, never the wrapped class's.

    Example:
        >>> class Base: pass
        >>> class Wrapper(Base): pass
        >>> class Users(Base): pass
        >>> cls, new = wrapper_subclass(Wrapper, Users)
        >>> issubclass(cls, Wrapper) and issubclass(cls, Users) and cls.__name__, new
        ('Wrapper', True)
        >>> wrapper_subclass(Wrapper, Users) == (cls, False)
        True
    """
    if issubclass(wrapper, wrapped_class):
        return wrapper, False
    key = (wrapper, wrapped_class)
    if key in _CLASSES:
        return _CLASSES[key], False
    cls = type(wrapper.__name__, (wrapper, wrapped_class), {
        "__module__": wrapper.__module__, "__qualname__": wrapper.__qualname__, "__doc__": wrapper.__doc__,
        "wrapper_class": wrapper})
    _CLASSES[key] = cls
    return cls, True
