"""Elastic data parallelism on Keras 3: ``hvd.elastic.run``, ``KerasState`` and its callbacks, Horovod's TF states.

Horovod's own Keras elastic state (``horovod.tensorflow.elastic.TensorFlowKerasState``) calls
``optimizer.variables()``, which Keras 3 made a list, and ``horovod.tensorflow.keras`` does not import on
Keras 3; this module keeps Horovod's elastic machinery (``run_fn``, ``ObjectState``, the driver's
notifications) and re-writes the Keras parts: the state copies ``model.variables`` and
``optimizer.variables`` (Dropout's seed generators and the iteration count included) and syncs them
with dualframe's ``broadcast_variables``. ``KerasState(model, optimizer=None, **kwargs)`` is Horovod's
signature: a custom loop's optimizer is part of the state.

One module for both imports, as ``hvd.elastic``: ``dualframe.tensorflow.keras`` (``KerasState`` and the
callbacks, for ``fit``) and ``dualframe.tensorflow`` (Horovod's GradientTape names: ``TensorFlowKerasState``,
the same state, and ``TensorFlowState``, a list of ``tf.Variable``, Horovod's own, which works on Keras 3
as it is).
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, TypeVar

import keras
import numpy as np
import tensorflow as tf
from horovod.common.elastic import ObjectState, run_fn
from horovod.common.exceptions import HorovodInternalError
from horovod.tensorflow.elastic import TensorFlowState

from dualframe.errors import StrategyError
from dualframe.tensorflow.collectives import hvd
from dualframe.tensorflow.functions import broadcast_variables

__all__ = ["run", "KerasState", "CommitStateCallback", "UpdateBatchStateCallback", "UpdateEpochStateCallback",
           "TensorFlowKerasState", "TensorFlowState"]

F = TypeVar("F", bound=Callable[..., Any])
#: Horovod's ops as TensorFlow names them in the error a lost peer causes inside a traced train step.
_HOROVOD_OPS = ("HorovodAllreduce", "HorovodAllgather", "HorovodBroadcast", "HorovodGroupedAllreduce")


class KerasState(ObjectState):  # type: ignore[misc]
    """A Keras model, its optimizer and progress, committed in memory, restored after a lost worker, synced to new ones.

    Horovod's signature: ``KerasState(model, optimizer=None, **kwargs)``. The optimizer given (a
    GradientTape loop's, the model not compiled) is the one committed, restored and synced; without
    one, the compiled model's (Horovod's ``optimizer or model.optimizer``). Keyword arguments
    (``epoch=0, batch=0``) become attributes kept the same way. The model must be built.

    Example:
        >>> state = KerasState(model, epoch=0, batch=0)                      # doctest: +SKIP
        >>> @run                                                             # doctest: +SKIP
        ... def train(state):
        ...     model.fit(x, y, initial_epoch=state.epoch, epochs=10, callbacks=[
        ...         UpdateEpochStateCallback(state), UpdateBatchStateCallback(state),
        ...         CommitStateCallback(state, batches_per_commit=10)])
        >>> state = KerasState(model, optimizer, batch=0)   # a custom loop's optimizer  # doctest: +SKIP

    Raises:
        StrategyError: ``model`` is not a built keras.Model, or ``optimizer`` not a Keras optimizer.
    """

    def __init__(self, model: keras.Model, optimizer: Optional[keras.optimizers.Optimizer] = None,
                 **kwargs: Any) -> None:
        if not isinstance(model, keras.Model):
            raise StrategyError(f"model must be a keras.Model (model: {type(model).__name__})")
        if not model.built:
            raise StrategyError(f"model {model.name!r} is not built: give it an Input or build it first")
        if optimizer is not None and not isinstance(optimizer, keras.optimizers.Optimizer):
            raise StrategyError(f"optimizer must be a keras.optimizers.Optimizer (optimizer: {type(optimizer).__name__})")
        self.model = model
        self._optimizer = optimizer
        self._saved_variables: List[np.ndarray] = []
        self._saved_shards: List[np.ndarray] = []
        super().__init__(bcast_object=hvd.broadcast_object, get_rank=hvd.rank, **kwargs)
        self._save_variables(gather=False)  # a joining worker builds alone: the others wait in sync

    @property
    def optimizer(self) -> Optional[keras.optimizers.Optimizer]:
        """The optimizer given, else the compiled model's (None for an uncompiled model without one)."""
        return self._optimizer if self._optimizer is not None else getattr(self.model, "optimizer", None)

    def _variables(self) -> List[Any]:
        optimizer = self.optimizer
        if optimizer is not None and not optimizer.built:
            optimizer.build(self.model.trainable_variables)
        return list(self.model.variables) + (list(optimizer.variables) if optimizer is not None else [])

    def _sharded(self) -> Any:
        """The optimizer if it shards its state (``DistributedOptimizer(shard=...)``), else None."""
        optimizer = self.optimizer
        return optimizer if hasattr(optimizer, "state_arrays") else None

    def _save_variables(self, gather: bool = True) -> None:
        self._saved_variables = [np.array(v.numpy()) for v in self._variables()]
        sharded = self._sharded()
        if not gather:
            return
        # Each rank holds a slice: keep the full state (gathered, every rank commits together), which
        # outlives a resize and is what sync re-cuts for the new number of ranks.
        self._saved_shards = sharded.state_arrays() if sharded is not None else []

    def save(self) -> None:
        """Keep a copy of the variables and attributes (``commit`` calls it)."""
        self._save_variables()
        super().save()

    def restore(self) -> None:
        """Go back to the last saved copy (after a worker was lost)."""
        for variable, value in zip(self._variables(), self._saved_variables):
            variable.assign(value)
        sharded = self._sharded()
        if sharded is not None and self._saved_shards:
            sharded.load_state_arrays(self._saved_shards)
        super().restore()

    def reset(self) -> None:
        """After workers left or joined: drop the model's traced train/test functions.

        A ``tf.function`` keeps the world size it was traced at (a step traced on one worker has no
        allreduce in it); ``fit`` re-traces them for the new size.
        """
        for name in ("train_function", "test_function", "predict_function"):
            if hasattr(self.model, name):
                setattr(self.model, name, None)
        super().reset()

    def sync(self) -> None:
        """Make every worker's model, optimizer and attributes rank 0's (at the start and after workers join)."""
        if hvd.size() > 1:
            broadcast_variables(self._variables(), root_rank=0)
        sharded = self._sharded()
        if sharded is not None:
            # Rank 0's last saved full state (a resize is noticed at a commit, so it is current), re-cut
            # for the ranks there are now.
            full = hvd.broadcast_object(self._saved_shards, root_rank=0) if hvd.size() > 1 else self._saved_shards
            if sharded.sharded_for() != sharded.reduction.process_set.size():
                sharded.reshard()
            if full:  # empty: rank 0 never committed, every rank's state is fresh
                sharded.load_state_arrays(full)
            sharded.recheck()
        self._save_variables()
        super().sync()


def _is_peer_loss(error: BaseException) -> bool:
    """A TensorFlow error from a Horovod op in a traced step: how a lost peer surfaces inside ``fit``."""
    message = getattr(error, "message", str(error))
    return isinstance(error, tf.errors.OpError) and any(op in message for op in _HOROVOD_OPS)


def _reset() -> None:
    hvd.shutdown()
    hvd.init()


def run(func: F) -> F:
    """Decorate ``func(state, ...)`` so training survives workers leaving and joining (Horovod's elastic loop).

    A lost worker shows up inside ``fit`` as a TensorFlow error from a Horovod op; it is turned into
    Horovod's ``HorovodInternalError`` so the survivors restore the last commit and call ``func`` again.

    Raises:
        StrategyError: ``func`` is not callable.
    """
    if not callable(func):
        raise StrategyError(f"run decorates a training function (got {type(func).__name__}: {func!r:.60})")

    def wrapper(state: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return func(state, *args, **kwargs)
        except tf.errors.OpError as error:
            if _is_peer_loss(error):
                raise HorovodInternalError(error) from error
            raise

    return run_fn(wrapper, _reset)  # type: ignore[no-any-return]


class CommitStateCallback(keras.callbacks.Callback):
    """Commit ``state`` every ``batches_per_commit`` batches and at each epoch's end.

    Put it after the Update*StateCallbacks, so a commit records the progress they set.

    Example:
        >>> CommitStateCallback(state, batches_per_commit=10)   # doctest: +SKIP
    """

    def __init__(self, state: KerasState, batches_per_commit: int = 1) -> None:
        super().__init__()
        if isinstance(batches_per_commit, bool) or not isinstance(batches_per_commit, int) or batches_per_commit < 1:
            raise StrategyError(f"batches_per_commit must be an int >= 1 (batches_per_commit: {batches_per_commit!r})")
        self.state, self.batches_per_commit = state, batches_per_commit
        self.remaining = batches_per_commit

    def on_train_begin(self, logs: Optional[Dict[str, Any]] = None) -> None:
        self.remaining = self.batches_per_commit  # the same on every rank after a reset

    def on_train_batch_end(self, batch: int, logs: Optional[Dict[str, Any]] = None) -> None:
        self.remaining -= 1
        if self.remaining == 0:
            self.state.commit()
            self.remaining = self.batches_per_commit

    def on_epoch_end(self, epoch: int, logs: Optional[Dict[str, Any]] = None) -> None:
        self.state.commit()


class UpdateBatchStateCallback(keras.callbacks.Callback):
    """Keep ``state.batch`` = the next batch of the epoch to train (0 at each epoch's end).

    ``fit`` restarted inside an epoch counts from 0 again: give it the epoch's data from
    ``state.batch`` on, and this callback adds the offset back.

    Example:
        >>> UpdateBatchStateCallback(state)   # doctest: +SKIP
    """

    def __init__(self, state: KerasState) -> None:
        super().__init__()
        self.state, self.offset = state, 0

    def on_epoch_begin(self, epoch: int, logs: Optional[Dict[str, Any]] = None) -> None:
        self.offset = int(self.state.batch)

    def on_train_batch_end(self, batch: int, logs: Optional[Dict[str, Any]] = None) -> None:
        self.state.batch = self.offset + batch + 1

    def on_epoch_end(self, epoch: int, logs: Optional[Dict[str, Any]] = None) -> None:
        self.state.batch = 0
        self.offset = 0


class UpdateEpochStateCallback(keras.callbacks.Callback):
    """Keep ``state.epoch`` = the next epoch to train: resume with ``fit(initial_epoch=state.epoch)``.

    Example:
        >>> UpdateEpochStateCallback(state)   # doctest: +SKIP
    """

    def __init__(self, state: KerasState) -> None:
        super().__init__()
        self.state = state

    def on_epoch_end(self, epoch: int, logs: Optional[Dict[str, Any]] = None) -> None:
        self.state.epoch = epoch + 1


class TensorFlowKerasState(KerasState):
    """A Keras model and the optimizer a custom loop applies with, committed, restored and synced as one state.

    Keyword arguments (``batch=0``) become attributes kept the same way. Without ``optimizer`` it
    uses the model's (a compiled model), as ``KerasState``.

    Example:
        >>> state = hvd.elastic.TensorFlowKerasState(model, optimizer, batch=0)   # doctest: +SKIP
        >>> @hvd.elastic.run                                                      # doctest: +SKIP
        ... def train(state):
        ...     for images, labels in dataset.skip(state.batch):
        ...         training_step(images, labels); state.batch += 1; state.commit()

    Raises:
        StrategyError: ``optimizer`` is not a Keras optimizer (or the model is not a built keras.Model).
    """

    # KerasState itself takes Horovod's (model, optimizer=None, **kwargs): this is its GradientTape name.
    def __init__(self, model: keras.Model, optimizer: Optional[keras.optimizers.Optimizer] = None,
                 backend: Any = None, **kwargs: Any) -> None:
        # backend: Horovod's TF 1 Keras backend, whose session ran the broadcasts; eagerly (Keras 3) Horovod
        # ignores it too.
        self.backend = backend
        super().__init__(model, optimizer, **kwargs)
