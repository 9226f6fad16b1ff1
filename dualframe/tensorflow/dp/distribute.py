"""distribute(model, strategy): the strategy-object path into the TensorFlow adapter."""
from __future__ import annotations

from typing import Any, Dict, Optional

import keras

from dualframe.errors import StrategyError
from dualframe.strategy import DataParallel, Strategy
from dualframe.tensorflow.dp.callbacks import broadcast_model
from dualframe.tensorflow.collectives import check_initialized
from dualframe.tensorflow.dp.optimizer import DistributedOptimizer, check_wrappable


def distribute(model: keras.Model, strategy: Optional[Strategy] = None, root_rank: int = 0) -> keras.Model:
    """Apply ``strategy`` to a compiled, built Keras model and return it.

    ``DataParallel``: the compiled optimizer is wrapped in a DistributedOptimizer with the
    strategy's op, compression, backward passes and shard (``"optimizer"``/``"gradients"``: the
    sharded optimizer, ZeRO-1/2), and the model and optimizer state are
    broadcast from ``root_rank`` now, so ``fit`` needs no broadcast callback. Compile again and
    the wrapping is gone: call ``distribute`` after ``compile``.

    ``shard="parameters"`` (ZeRO-3) returns a NEW model, compiled alike, that holds no values of its
    own (``ShardedOptimizer.shard_model``): keep the returned one (``model = distribute(model, ...)``)
    and drop the given one, whose memory is then freed.

    Example:
        >>> model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")     # doctest: +SKIP
        >>> model = hvd.distribute(model, dualframe.DataParallel(compression="fp16"))  # doctest: +SKIP
        >>> model.fit(hvd.shard(dataset).batch(32))                          # doctest: +SKIP
    """
    strategy = DataParallel() if strategy is None else strategy
    if not isinstance(strategy, DataParallel):
        raise StrategyError(
            f"dualframe.tensorflow.distribute handles dualframe.DataParallel (strategy: {type(strategy).__name__}); "
            f"for model splits and pipelines see docs/model_parallel.md")
    return _data_parallel(model, strategy, root_rank)


def _data_parallel(model: Any, strategy: DataParallel, root_rank: int) -> keras.Model:
    check_initialized("distribute")
    if not isinstance(model, keras.Model):
        raise TypeError(f"distribute needs a keras.Model (got {type(model).__name__})")
    if getattr(model, "optimizer", None) is None:
        raise StrategyError("compile the model before distribute(model, DataParallel(...)) (model.optimizer: None)")
    if not model.built:
        raise StrategyError(f"build the model before distribute (call it on a batch or give an Input) "
                            f"(model {model.name!r} is not built)")
    check_wrappable(model.optimizer)
    if strategy.shard == "parameters":
        return _parameters_sharded(model, strategy, root_rank)
    # shard= only when sharded: the loss-scaling wrapper (mixed_float16) takes no shard argument.
    sharding: Dict[str, Any] = {} if strategy.shard == "none" else {"shard": strategy.shard}
    model.optimizer = DistributedOptimizer(
        model.optimizer, compression=strategy.compression, op=strategy.op,
        backward_passes_per_step=strategy.backward_passes_per_step,
        gradient_predivide_factor=strategy.gradient_predivide_factor, **sharding)
    model.train_function = None  # traced with the old optimizer, if ever
    broadcast_model(model, root_rank)
    return model


def _parameters_sharded(model: keras.Model, strategy: DataParallel, root_rank: int) -> keras.Model:
    """ZeRO-3: the storage-free copy that ``shard_model`` makes, compiled with the given model's compile settings."""
    config = dict(model.get_compile_config() or {})
    config.pop("optimizer", None)
    settings = keras.saving.deserialize_keras_object(config)
    optimizer = DistributedOptimizer(
        model.optimizer, compression=strategy.compression, op=strategy.op, shard="parameters",
        backward_passes_per_step=strategy.backward_passes_per_step,
        gradient_predivide_factor=strategy.gradient_predivide_factor)
    sharded: keras.Model = optimizer.shard_model(model, root_rank)
    sharded.compile(optimizer=optimizer, **settings)
    return sharded
