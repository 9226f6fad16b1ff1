"""ZeRO-3 for Keras 3: a model that holds no values of its own, its layers gathering theirs from every rank's slices.

``opt.shard_model(model)`` (``opt = hvd.DistributedOptimizer(..., shard="parameters")``) rebuilds the
model from its config under ``keras.StatelessScope(initialize_variables=False)``, so its variables have
shapes but no storage, and cuts root's values into this rank's slices (the optimizer's flat slice
variables, one or more buckets per layer: the core's :class:`dualframe.dp.shard.ShardLayout`). Each
layer then gathers its values just before its call and again for its backward, and reduce-scatters
its gradient (:mod:`dualframe.tensorflow.dp.shard.layers`); the optimizer updates the slices.

Non-trainable variables (batch-norm statistics) stay whole on every rank, as in plain data
parallelism. The model can be called, evaluated and fitted as usual; the returned model's
``train_step`` differentiates with respect to the slices, and ``get_weights``, ``set_weights``,
``save_weights`` and ``load_weights`` work on the full values in Keras's plain layout (``get_weights``
and ``save_weights`` gather: every rank calls them).
"""
from __future__ import annotations

import contextlib
import functools
from typing import Any, Dict, List, Sequence

import keras
import numpy as np
import tensorflow as tf

from dualframe.dp.checks import check_root_rank
from dualframe.errors import StrategyError
from dualframe.tensorflow.dp.shard import layers as sharded_layers
from dualframe.tensorflow.collectives import hvd
from dualframe.tensorflow.dp.gradients import SHARD_SCOPE, collective_scope, named


def shard_model(optimizer: Any, model: keras.Model, root_rank: int = 0) -> keras.Model:
    """A storage-free copy of ``model`` whose values are ``optimizer``'s slices, cut from ``root_rank``'s values.

    ``root_rank`` is a rank of the optimizer's process set (0: its first rank, whichever rank of the job that is).

    Checks everything (the model on every rank alike included) before the broadcast of root's values;
    the given model is only read (drop it to free its memory).

    Raises:
        StrategyError: the optimizer is not ``shard="parameters"`` or already holds a model, the model is
            not built, Keras cannot rebuild it from its config,
            a variable is shared by two layers, or the ranks' models differ.
    """
    process_set = optimizer.reduction.process_set
    if getattr(optimizer, "shard", None) != "parameters":
        raise StrategyError(f"shard_model needs hvd.DistributedOptimizer(..., shard='parameters') "
                            f"(shard: {getattr(optimizer, 'shard', None)!r})")
    if optimizer.built or optimizer._zero.model is not None:
        raise StrategyError("this optimizer already holds a model's slices; make one optimizer per model")
    if not isinstance(model, keras.Model):
        raise TypeError(f"shard_model needs a keras.Model (got {type(model).__name__})")
    if not model.built:
        raise StrategyError(f"build the model before shard_model (call it on a batch or give an Input) "
                            f"(model {model.name!r} is not built)")
    check_root_rank(root_rank, process_set.size())
    clone = storage_free_clone(model)
    shapes = [tuple(v.shape) for v in model.trainable_variables]
    if [tuple(v.shape) for v in clone.trainable_variables] != shapes:
        raise StrategyError(
            f"shard='parameters' rebuilt {model.name!r} from its config with other trainable variables "
            f"({len(clone.trainable_variables)} against {len(shapes)}): Keras's config does not keep a layer "
            f"shared between nested models; use shard='gradients' for it")
    zero = optimizer._zero
    zero.planned, zero.blocks = sharded_layers.layer_plan(clone, process_set.size(), optimizer.bucket_elements)
    optimizer._check_same_everywhere(clone.trainable_variables, process_set.size())  # the one collective before
    zero.checked = True
    zero.values = [_broadcast(v, root_rank, process_set) for v in model.trainable_variables]
    zero.replicated = [keras.Variable(_broadcast(v, root_rank, process_set), trainable=False,
                                      name=f"dualframe_replicated_{i}")
                       for i, v in enumerate(model.non_trainable_variables)]
    zero.model = clone
    optimizer.build(clone.trainable_variables)
    sharded_layers.install(optimizer, clone)
    for name, function in (("train_step", _train_step), ("get_weights", _get_weights), ("set_weights", _set_weights),
                           ("save_weights", _save_weights), ("load_weights", _load_weights), ("save", _save)):
        setattr(clone, name, functools.partial(function, optimizer))
    return clone


def storage_free_clone(model: keras.Model) -> keras.Model:
    """``model`` rebuilt from its config with variables that have shapes and no values (no communication)."""
    return _rebuilt(model, keras.StatelessScope(initialize_variables=False))


def _rebuilt(model: keras.Model, scope: Any) -> keras.Model:
    try:
        config = keras.saving.serialize_keras_object(model)
        config.pop("compile_config", None)  # compiling builds an optimizer, whose variables need values
        with scope:
            clone: keras.Model = keras.saving.deserialize_keras_object(config)
        return clone
    except Exception as error:  # a subclassed model without get_config, a layer that cannot be rebuilt ...
        raise StrategyError(
            f"shard='parameters' rebuilds the model from its config (keras.saving), which failed for "
            f"{type(model).__name__} {model.name!r}: {error}. Use a functional or Sequential model, or a "
            f"subclassed one with get_config") from error


def _broadcast(variable: Any, root_rank: int, process_set: Any) -> tf.Tensor:
    """``variable``'s value on the set's rank ``root_rank`` (Horovod names the root by its rank in the job)."""
    value = tf.convert_to_tensor(variable)
    if process_set.size() == 1:
        return tf.identity(value)
    ranks = getattr(process_set, "ranks", None)
    return hvd.broadcast(value, ranks[root_rank] if ranks else root_rank, process_set=process_set)


def gather(optimizer: Any) -> List[tf.Tensor]:
    """Every trainable variable's full value, allgathered from the ranks' slices (a collective)."""
    zero, process_set = optimizer._zero, optimizer.reduction.process_set
    values = [tf.convert_to_tensor(s) for s in zero.slices]
    if process_set.size() > 1:
        with collective_scope(SHARD_SCOPE):
            values = list(hvd.grouped_allgather(named(values, "parameter"), process_set=process_set))
    return zero.unflatten(values)  # type: ignore[no-any-return]


def _train_step(optimizer: Any, data: Any) -> Dict[str, Any]:
    """Keras's train step, differentiating with respect to the slices (each layer's backward reduces its share)."""
    model = optimizer._zero.model
    stepper = _stepper(optimizer, model)
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
    with tf.GradientTape() as tape:
        y_pred = model(x, training=True)
        loss = model.compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=True)
        scaled = stepper.scale_loss(loss)
    first = next(t for t in tf.nest.flatten(x) if t is not None)
    for metric in model.metrics:
        if metric.name == "loss":  # Keras's loss tracker, which fit reports
            metric.update_state(loss, sample_weight=tf.shape(first)[0])
    slices = optimizer.parameter_slices()
    stepper.apply(tape.gradient(scaled, slices), slices)
    return model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)  # type: ignore[no-any-return]


def _stepper(optimizer: Any, model: keras.Model) -> Any:
    """What fit steps with: the compiled ``ShardedLossScaleOptimizer`` around ``optimizer``, else ``optimizer``.

    Raises:
        StrategyError: Keras's own LossScaleOptimizer wraps it (compile adds one under ``mixed_float16``
            to an optimizer made before the policy was set): its skip decision would be each rank's own.
    """
    compiled, guard = getattr(model, "optimizer", None), optimizer._zero.guard
    if getattr(compiled, "inner_optimizer", None) is not optimizer:
        return optimizer
    if guard is None:  # no ShardedLossScaleOptimizer installed its guard
        raise StrategyError(
            f"shard='parameters' under loss scaling needs hvd.DistributedOptimizer to make the LossScaleOptimizer "
            f"(compiled: Keras's {type(compiled).__name__} around the sharded optimizer, which would skip steps "
            f"on some ranks only): set the mixed_float16 policy before hvd.DistributedOptimizer(..., "
            f"shard='parameters'), or pass it keras.optimizers.LossScaleOptimizer(optimizer)")
    return compiled


def _get_weights(optimizer: Any) -> List[np.ndarray]:
    """The model's full weights in ``model.weights`` order (a collective: every rank calls)."""
    zero = optimizer._zero
    values = {id(v): value for v, value in zip(zero.model.trainable_variables, gather(optimizer))}
    values.update({id(v): h for v, h in zip(zero.model.non_trainable_variables, zero.replicated)})
    return [np.asarray(values[id(v)]).astype(str(v.dtype)) for v in zero.model.weights]  # float16: the master cast


def _set_weights(optimizer: Any, weights: Sequence[Any]) -> None:
    """Take this rank's slices of full ``weights`` (``model.weights`` order; no communication)."""
    model = optimizer._zero.model
    if len(weights) != len(model.weights):
        raise StrategyError(f"set_weights needs one array per weight (weights: {len(model.weights)}, "
                            f"given: {len(weights)})")
    _take({id(v): w for v, w in zip(model.weights, weights)}, optimizer)


def _take(by_variable: Dict[int, Any], optimizer: Any) -> None:
    zero = optimizer._zero
    zero.load_slices([tf.convert_to_tensor(by_variable[id(v)], dtype=v.dtype) for v in zero.model.trainable_variables])
    for variable, holder in zip(zero.model.non_trainable_variables, zero.replicated):
        if id(variable) in by_variable:  # a seed generator's state is no weight: it goes on as it was
            holder.assign(by_variable[id(variable)])


def _save_weights(optimizer: Any, filepath: Any, *args: Any, **kwargs: Any) -> None:
    """Keras's ``save_weights`` of the gathered values, in the plain layout (every rank calls; the set's rank 0 writes).

    Rank 0 writes through a plain copy of the model (rebuilt from its config, holding values): the full
    model exists there while the file is written.
    """
    weights = _get_weights(optimizer)
    if optimizer.reduction.process_set.rank() == 0:
        plain = _rebuilt(optimizer._zero.model, contextlib.nullcontext())
        plain.set_weights(weights)
        plain.save_weights(filepath, *args, **kwargs)


def _save(optimizer: Any, *args: Any, **kwargs: Any) -> None:
    """Refused: Keras's whole-model saving reads the variables, which hold no values here."""
    raise StrategyError("model.save of a shard='parameters' (ZeRO-3) model would write its variables' placeholders; "
                        "use model.save_weights (every rank calls; the file is plain Keras) and the optimizer's "
                        "opt.state_arrays()")


def _load_weights(optimizer: Any, filepath: Any, *args: Any, **kwargs: Any) -> None:
    """Keras's ``load_weights`` of a plain (unsharded) file, this rank keeping its slices (no communication).

    The file is read into a plain copy of the model, which holds the full values while this rank cuts its slices.
    """
    plain = _rebuilt(optimizer._zero.model, contextlib.nullcontext())
    plain.load_weights(filepath, *args, **kwargs)
    _set_weights(optimizer, plain.get_weights())
