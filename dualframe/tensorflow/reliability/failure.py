"""The TensorFlow side of failure handling: the stall watchdog around eager collectives, Keras train steps and tf.function steps.

Horovod's TensorFlow collectives are graph ops: inside ``tf.function`` or Keras ``fit`` the wait on the
other ranks happens in C++, where no Python wrapper can time it. What can be timed is the Python call
that runs the graph, so dualframe bounds, by ``DUALFRAME_STALL_TIMEOUT`` seconds (``dualframe.reliability.failure``):

* every eager dualframe.tensorflow collective (``allreduce`` ... ``barrier``, ``broadcast_variables``,
  ``DistributedGradientTape.gradient`` run eagerly, checkpoint saves and loads): :func:`eager_guard`;
* every Keras train step (``model.train_function``), as soon as ``fit`` is given
  ``BroadcastGlobalVariablesCallback``, ``CheckpointCallback`` or :class:`StallGuardCallback`:
  :func:`guard_train_function`;
* a custom ``tf.function`` step, wrapped by the user in :func:`stall_guard`.
"""
from __future__ import annotations

import contextlib
from typing import Any, ContextManager, Dict, Optional

import keras
import tensorflow as tf

from dualframe.reliability import failure
from dualframe.reliability.failure import Watchdog


def stall_guard(what: str = "a training step") -> ContextManager[None]:
    """Bound the ``with`` block by the stall watchdog: past ``DUALFRAME_STALL_TIMEOUT`` the job ends.

    For custom loops whose collectives run inside a ``tf.function``, where dualframe cannot see them.
    With one process, or the watchdog off, it costs one comparison.

    Example:
        >>> for x, y in dataset:                              # doctest: +SKIP
        ...     with hvd.stall_guard("train step"):
        ...         loss = train_step(x, y)                   # a tf.function with DistributedGradientTape

    Args:
        what: what the block waits on, printed when it stalls.
    """
    if not isinstance(what, str) or not what:
        raise TypeError(f"what must be a non-empty string naming the guarded call (what: {what!r})")
    return failure.watchdog().guard(what)


def eager_guard(what: str) -> ContextManager[None]:
    """Bound an eager Horovod collective; a no-op while a ``tf.function`` is traced (nothing waits then)."""
    if not tf.executing_eagerly():
        return contextlib.nullcontext()
    return failure.watchdog().guard(f"a Horovod collective ({what})")


class GuardedStep:
    """A Keras train function whose every call is bounded by the stall watchdog.

    Example:
        >>> model.train_function = GuardedStep(model.train_function, failure.watchdog())  # doctest: +SKIP
    """

    def __init__(self, step: Any, watchdog: Watchdog, what: str = "a Keras train step") -> None:
        if isinstance(step, GuardedStep):
            raise TypeError("this train function is already guarded; wrap it only once")
        self.step, self.watchdog, self.what = step, watchdog, what

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with self.watchdog.guard(f"{self.what} (its gradient allreduce, in Keras fit)"):
            return self.step(*args, **kwargs)


def guard_train_function(model: keras.Model) -> bool:
    """Make ``model``'s train function (built now if needed) bounded by the stall watchdog.

    Called from ``on_train_begin`` (after ``fit`` built the function). ``compile`` drops the wrapper
    with the function; the next ``fit`` wraps the new one.

    Returns:
        True when the function is (now) guarded; False with one process or the watchdog off.
    """
    watchdog = failure.watchdog()
    if watchdog.timeout <= 0:
        return False
    step = model.make_train_function()
    if not isinstance(step, GuardedStep):
        model.train_function = GuardedStep(step, watchdog)
    return True


class StallGuardCallback(keras.callbacks.Callback):
    """Bound every train step of ``fit`` by ``DUALFRAME_STALL_TIMEOUT``: a step whose collectives never complete ends the job.

    ``BroadcastGlobalVariablesCallback`` and ``CheckpointCallback`` already do this; give this one to a
    ``fit`` that has neither (an elastic loop, a model broadcast by hand).

    Example:
        >>> model.fit(x, y, callbacks=[hvd.callbacks.StallGuardCallback()])  # doctest: +SKIP
    """

    def on_train_begin(self, logs: Optional[Dict[str, Any]] = None) -> None:
        guard_train_function(self.model)
