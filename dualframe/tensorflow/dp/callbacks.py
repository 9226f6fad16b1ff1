"""Keras 3 callbacks for data parallelism: broadcast state, average metrics, warm up and schedule the learning rate."""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence, Union

import keras
import tensorflow as tf

from dualframe.dp.checks import check_root_rank
from dualframe.errors import StrategyError
from dualframe.tensorflow.collectives import check_initialized, hvd
from dualframe.tensorflow.reliability.failure import StallGuardCallback, guard_train_function  # noqa: F401 (hvd.callbacks.StallGuardCallback)
from dualframe.tensorflow.functions import allreduce, broadcast_variables
from horovod.common.util import is_version_greater_equal_than  # noqa: F401 (Horovod's callbacks module exports it)


def broadcast_model(model: keras.Model, root_rank: int = 0, local_variables: Sequence[Any] = ()) -> None:
    """Make ``model``'s variables and its optimizer's state equal to ``root_rank``'s on every rank.

    The optimizer is built first (its slots, iteration count, accumulators), so its state is sent
    before the first update rather than after it. ``local_variables`` (Horovod's argument) stay as
    each rank has them.

    Raises:
        StrategyError: the model is not built (it has no variables to send yet).
    """
    check_initialized("broadcast_model")
    check_root_rank(root_rank, hvd.size())
    if not model.built:
        raise StrategyError(f"model {model.name!r} has no variables yet: build it first (give it an Input, call it "
                            f"on a batch, or model.build(input_shape))")
    variables = list(model.variables)
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None:
        if not optimizer.built:
            optimizer.build(model.trainable_variables)
        variables += list(optimizer.variables)
    kept = {id(variable) for variable in local_variables}
    broadcast_variables([v for v in variables if id(v) not in kept], root_rank)


class BroadcastGlobalVariablesCallback(keras.callbacks.Callback):
    """Copy rank ``root_rank``'s model and optimizer state to every rank before the first update.

    Unlike Horovod's (which broadcasts after the first batch, so that batch's update depends on each
    rank's own random start), the state is equal before the first update -- provided the model is
    built when ``fit`` starts (it has an ``Input``, or was called or built). A model that ``fit``
    itself builds, while it traces the first step, has no variables before that step; then the
    broadcast falls back to Horovod's moment, after the first batch, and ranks are equal from there.
    Under a launcher it also bounds every train step by ``DUALFRAME_STALL_TIMEOUT`` (see
    ``hvd.callbacks.StallGuardCallback``): ranks whose collectives disagree end the job, not hang.
    ``local_variables`` (Horovod's argument, e.g. a layer kept per rank) are not sent.

    Example:
        >>> model.fit(x, y, callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])  # doctest: +SKIP
    """

    def __init__(self, root_rank: int, device: str = "", local_variables: Optional[Sequence[Any]] = None) -> None:
        super().__init__()
        if isinstance(root_rank, bool) or not isinstance(root_rank, int) or root_rank < 0:
            raise StrategyError(f"root_rank must be an int >= 0 (root_rank: {root_rank!r})")
        local = list(local_variables or [])
        if not all(isinstance(v, (keras.Variable, tf.Variable)) for v in local):
            kinds = sorted({type(v).__name__ for v in local})
            raise StrategyError(f"local_variables must be variables (got {', '.join(kinds)})")
        self.root_rank = root_rank
        self.local_variables = local
        self.broadcast_done = False

    def _broadcast(self) -> None:
        broadcast_model(self.model, self.root_rank, self.local_variables)
        self.broadcast_done = True

    def on_train_begin(self, logs: Optional[Dict[str, Any]] = None) -> None:
        guard_train_function(self.model)  # a step that waits on the ranks past DUALFRAME_STALL_TIMEOUT ends the job
        if self.broadcast_done:
            return
        if self.model.built:
            self._broadcast()

    def on_train_batch_end(self, batch: int, logs: Optional[Dict[str, Any]] = None) -> None:
        if not self.broadcast_done:
            self._broadcast()


class MetricAverageCallback(keras.callbacks.Callback):
    """At each epoch's end, replace every metric in ``logs`` by its average over the ranks.

    Put it before callbacks that read the metrics (ReduceLROnPlateau, checkpointing, logging).

    Example:
        >>> callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(0),   # doctest: +SKIP
        ...              hvd.callbacks.MetricAverageCallback()]
    """

    def __init__(self, device: str = "") -> None:
        super().__init__()

    def on_epoch_end(self, epoch: int, logs: Optional[Dict[str, Any]] = None) -> None:
        if not logs:
            return
        keys = sorted(k for k, v in logs.items() if isinstance(v, (int, float)) or _is_scalar(v))
        if not keys:
            return
        values = tf.constant([float(logs[k]) for k in keys], dtype=tf.float64)
        averaged = allreduce(values, op=hvd.Average, name="dualframe.metric_average").numpy()
        for key, value in zip(keys, averaged):
            logs[key] = float(value)


def _is_scalar(value: Any) -> bool:
    shape = getattr(value, "shape", None)
    return shape is not None and len(shape) == 0


class LearningRateScheduleCallback(keras.callbacks.Callback):
    """Set the learning rate to ``initial_lr * multiplier(epoch)`` between ``start_epoch`` and ``end_epoch``.

    ``multiplier`` is a number or a function of the epoch. With ``staircase=False`` the epoch is
    fractional (``epoch + batch / steps_per_epoch``) and the rate changes every batch.
    ``momentum_correction`` is accepted for Horovod compatibility and has no effect: a Keras 3
    optimizer's momentum is a constant of the compiled train step, not something a callback can change.

    Example:
        >>> hvd.callbacks.LearningRateScheduleCallback(0.1, multiplier=0.1, start_epoch=30)  # doctest: +SKIP
    """

    def __init__(self, initial_lr: float, multiplier: Union[float, Callable[[float], float]],
                 start_epoch: int = 0, end_epoch: Optional[int] = None, staircase: bool = True,
                 momentum_correction: bool = True, steps_per_epoch: Optional[int] = None, *,
                 verbose: int = 0) -> None:
        super().__init__()
        if isinstance(initial_lr, bool) or not isinstance(initial_lr, (int, float)) or initial_lr <= 0:
            raise StrategyError(f"initial_lr must be a number > 0 (initial_lr: {initial_lr!r})")
        if end_epoch is not None and end_epoch <= start_epoch:
            raise StrategyError(f"end_epoch must be after start_epoch (start_epoch: {start_epoch}, end_epoch: {end_epoch})")
        if steps_per_epoch is not None and steps_per_epoch < 1:
            raise StrategyError(f"steps_per_epoch must be >= 1 (steps_per_epoch: {steps_per_epoch})")
        self.initial_lr = float(initial_lr)
        self.multiplier = multiplier if callable(multiplier) else (lambda epoch: float(multiplier))
        self.start_epoch, self.end_epoch = start_epoch, end_epoch
        self.staircase, self.momentum_correction = staircase, momentum_correction
        self.steps_per_epoch, self.verbose = steps_per_epoch, verbose
        self.current_epoch = 0

    def learning_rate_at(self, epoch: float) -> float:
        """The rate this callback sets at (possibly fractional) ``epoch``."""
        return self.initial_lr * float(self.multiplier(epoch))

    def _active(self, epoch: float) -> bool:
        return self.start_epoch <= epoch and (self.end_epoch is None or epoch < self.end_epoch)

    def _set(self, epoch: float) -> None:
        self.model.optimizer.learning_rate = self.learning_rate_at(epoch)

    def on_epoch_begin(self, epoch: int, logs: Optional[Dict[str, Any]] = None) -> None:
        self.current_epoch = epoch
        if self.staircase and self._active(epoch):
            self._set(epoch)

    def on_train_batch_begin(self, batch: int, logs: Optional[Dict[str, Any]] = None) -> None:
        if self.staircase or not self._active(self.current_epoch):
            return
        steps = self.steps_per_epoch or (self.params or {}).get("steps")
        if not steps:
            raise StrategyError("LearningRateScheduleCallback(staircase=False) needs steps_per_epoch "
                                "(fit did not report the number of steps per epoch)")
        self._set(self.current_epoch + batch / steps)


class LearningRateWarmupCallback(LearningRateScheduleCallback):
    """Ramp the learning rate from ``initial_lr / size()`` to ``initial_lr`` over ``warmup_epochs``.

    (Goyal et al., "Accurate, Large Minibatch SGD"): start at the one-process rate, end at the
    rate scaled for ``size()`` processes.

    Example:
        >>> hvd.callbacks.LearningRateWarmupCallback(0.1 * hvd.size(), warmup_epochs=3)  # doctest: +SKIP
    """

    def __init__(self, initial_lr: float, warmup_epochs: int = 5, momentum_correction: bool = True,
                 steps_per_epoch: Optional[int] = None, verbose: int = 0) -> None:
        check_initialized("LearningRateWarmupCallback")
        if isinstance(warmup_epochs, bool) or not isinstance(warmup_epochs, int) or warmup_epochs < 1:
            raise StrategyError(f"warmup_epochs must be an int >= 1 (warmup_epochs: {warmup_epochs!r})")
        size = hvd.size()

        def multiplier(epoch: float) -> float:
            return 1.0 / size * (epoch * (size - 1) / warmup_epochs + 1)

        super().__init__(initial_lr, multiplier, start_epoch=0, end_epoch=warmup_epochs, staircase=False,
                         momentum_correction=momentum_correction, steps_per_epoch=steps_per_epoch, verbose=verbose)
        self.warmup_epochs = warmup_epochs

    def on_epoch_end(self, epoch: int, logs: Optional[Dict[str, Any]] = None) -> None:
        if epoch == self.warmup_epochs - 1:
            self._set(self.warmup_epochs)
            if self.verbose and hvd.rank() == 0:
                print(f"\nEpoch {epoch + 1}: finished gradual learning rate warmup to {self.initial_lr:g}.")


class BestModelCheckpoint(keras.callbacks.ModelCheckpoint):
    """Save the model with the best ``monitor`` value so far, on rank 0 only (Horovod's, with Keras 3's saving).

    Horovod's signature leaves the file out (its Spark estimator sets ``filepath`` later); here
    ``filepath`` may be given as a keyword, or set on the callback before ``fit``. Put
    ``MetricAverageCallback`` before it so the best epoch is judged on the ranks' average.

    Example:
        >>> callbacks = [hvd.callbacks.MetricAverageCallback(),                      # doctest: +SKIP
        ...              hvd.callbacks.BestModelCheckpoint(monitor="val_loss", filepath="best.keras")]

    Raises:
        StrategyError: at ``fit``'s start, when no ``filepath`` was given or set.
    """

    def __init__(self, monitor: str = "val_loss", verbose: int = 0, save_weights_only: bool = False,
                 mode: str = "auto", save_freq: Union[str, int] = "epoch", *, filepath: Optional[str] = None) -> None:
        # Keras 3 checks the file's suffix in its constructor: a placeholder passes it until filepath is set.
        placeholder = "best.weights.h5" if save_weights_only else "best.keras"
        super().__init__(filepath=filepath or placeholder, monitor=monitor, verbose=verbose, save_best_only=True,
                         save_weights_only=save_weights_only, mode=mode, save_freq=save_freq)
        self.filepath = filepath

    def on_train_begin(self, logs: Optional[Dict[str, Any]] = None) -> None:
        if not self.filepath:
            raise StrategyError("BestModelCheckpoint has no filepath: pass filepath='best.keras' or set "
                                "callback.filepath before fit")

    def _save_model(self, epoch: int, batch: Optional[int], logs: Optional[Dict[str, Any]]) -> None:
        if hvd.rank() == 0:  # one writer; the other ranks hold the same model
            super()._save_model(epoch, batch, logs)


def rank_zero_only(*callbacks: keras.callbacks.Callback) -> List[keras.callbacks.Callback]:
    """``callbacks`` on rank 0 and an empty list elsewhere: for checkpoints, TensorBoard, CSV logs.

    Only for callbacks that do not communicate. Example:
        >>> callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(0),   # doctest: +SKIP
        ...              *hvd.callbacks.rank_zero_only(keras.callbacks.ModelCheckpoint("ckpt.keras"))]
    """
    check_initialized("rank_zero_only")
    return list(callbacks) if hvd.rank() == 0 else []


def verbose(level: int = 1) -> int:
    """``level`` on rank 0, 0 elsewhere: ``model.fit(..., verbose=hvd.verbose())``."""
    check_initialized("verbose")
    return level if hvd.rank() == 0 else 0
