"""DistributedOptimizer for Keras 3: a wrapper optimizer that averages gradients across ranks before applying them."""
from __future__ import annotations

import inspect
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import keras
import tensorflow as tf
from keras import ops

from dualframe.dp.checks import check_bool, compression_name
from dualframe.dp.shard import check_scatter, check_shard
from dualframe.dp.zero3 import refuse_zero3_only
from dualframe.errors import StrategyError
from dualframe.tensorflow.collectives import hvd
from dualframe.tensorflow.dp.compression import Compression
from dualframe.tensorflow.dp.gradients import ReduceSettings, reduce_gradients
from dualframe.tensorflow.dp.wrapped_optimizer import InnerAttributes, KerasTwoNames, optimizer_subclass

_WRAPPERS: tuple = ()  # filled below: both wrapper classes, for the "wrapped twice" check


class GradientAccumulation:
    """Horovod's ``backward_passes_per_step``: sum gradients locally, reduce and apply every N-th call.

    Its variables are created through the optimizer (``add_variable``), so they are saved, loaded and
    broadcast with the optimizer's state.
    """

    def __init__(self, backward_passes_per_step: int, average_aggregated_gradients: bool) -> None:
        self.steps = backward_passes_per_step
        self.average = average_aggregated_gradients
        self.trainable_variables: List[Any] = []
        self.buffers: List[Any] = []
        self.counter: Any = None

    def build(self, optimizer: keras.optimizers.Optimizer, var_list: Sequence[Any]) -> None:
        """Remember the variables; with N > 1 create one accumulator per variable and a counter."""
        self.trainable_variables = list(var_list)
        if self.steps > 1:
            self.counter = optimizer.add_variable((), initializer="zeros", dtype="int32",
                                                  name="dualframe_backward_passes")
            self.buffers = [optimizer.add_variable_from_reference(v, name="dualframe_accumulated_gradient")
                            for v in var_list]

    def step(self, grads: List[Any], apply: Callable[[List[Any]], None]) -> None:
        """Call ``apply`` with these gradients, or with the accumulated ones on every N-th step."""
        if self.steps == 1:
            apply(grads)
            return
        present = [g is not None for g in grads]
        for buffer, grad in zip(self.buffers, grads):
            if grad is not None:
                buffer.assign_add(tf.convert_to_tensor(grad))
        self.counter.assign_add(1)

        def boundary() -> None:
            scale = 1.0 / self.steps if self.average else 1.0
            summed = [ops.convert_to_tensor(b) * scale if p else None for b, p in zip(self.buffers, present)]
            apply(summed)
            for buffer in self.buffers:
                buffer.assign(ops.zeros_like(buffer))
            self.counter.assign(0)

        ops.cond(ops.equal(self.counter, self.steps), boundary, lambda: None)


def register_wrapper(cls: type) -> None:
    """Count ``cls`` among dualframe's wrappers (the sharded optimizer joins from its own module)."""
    global _WRAPPERS
    _WRAPPERS = _WRAPPERS + (cls,)


def check_wrappable(optimizer: object) -> None:
    """A Keras 3 optimizer that is not already distributed."""
    if isinstance(optimizer, _WRAPPERS) or isinstance(getattr(optimizer, "inner_optimizer", None), _WRAPPERS):
        raise StrategyError(
            f"the optimizer is already distributed ({type(optimizer).__name__}); wrap it with "
            f"hvd.DistributedOptimizer only once")
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise TypeError(
            f"DistributedOptimizer wraps a keras.optimizers.Optimizer (got {type(optimizer).__name__}: "
            f"{optimizer!r:.80}); for a name, pass keras.optimizers.get({optimizer!r:.20})")


def wrap_settings(optimizer: object, compression: Any, op: Any, sparse_as_dense: Any,
                  gradient_predivide_factor: Any, backward_passes_per_step: Any,
                  average_aggregated_gradients: Any, process_set: Any,
                  device_dense: str = "", device_sparse: str = "", groups: Any = None,
                  num_groups: Any = 0) -> "tuple[ReduceSettings, GradientAccumulation]":
    """Every check DistributedOptimizer makes, before it creates anything or communicates."""
    check_wrappable(optimizer)
    settings = ReduceSettings.build("DistributedOptimizer", compression, op, sparse_as_dense,
                                    gradient_predivide_factor, process_set, backward_passes_per_step,
                                    device_dense, device_sparse, groups, num_groups)
    check_bool("average_aggregated_gradients", average_aggregated_gradients)
    return settings, GradientAccumulation(backward_passes_per_step, average_aggregated_gradients)


def _config(settings: ReduceSettings, accumulation: GradientAccumulation) -> Dict[str, Any]:
    return {"compression": compression_name(settings.compression), "op": settings.op,
            "sparse_as_dense": settings.sparse_as_dense,
            "gradient_predivide_factor": settings.gradient_predivide_factor,
            "backward_passes_per_step": accumulation.steps,
            "average_aggregated_gradients": accumulation.average}


def wants_loss_scaling(optimizer: object) -> bool:
    """A ``LossScaleOptimizer``, or a plain (not yet distributed) optimizer while the global policy is ``mixed_float16``."""
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        return True
    return (keras.mixed_precision.global_policy().name == "mixed_float16"
            and isinstance(optimizer, keras.optimizers.Optimizer) and not isinstance(optimizer, _WRAPPERS))


@keras.saving.register_keras_serializable(package="dualframe")
class DistributedOptimizer(InnerAttributes, keras.optimizers.Optimizer):
    """Wraps a Keras 3 optimizer: gradients are averaged over all ranks, then the inner optimizer applies them.

    As Horovod's, the result is an instance of the wrapped optimizer's class too
    (``isinstance(hvd.DistributedOptimizer(keras.optimizers.Adam()), keras.optimizers.Adam)``; see
    ``dualframe.tensorflow.dp.wrapped_optimizer``), and one optimizer may be wrapped several times.
    Works with ``model.compile``/``fit``, a custom ``train_step``, learning-rate schedules, saving
    and loading. Given a ``keras.optimizers.LossScaleOptimizer`` (or any optimizer while the global
    policy is ``mixed_float16``, where ``compile`` would add one), it returns a
    ``DistributedLossScaleOptimizer``, which reduces the scaled gradients before the finite check so
    every rank takes the same decision.

    Args:
        optimizer: the Keras optimizer to wrap.
        compression: ``hvd.Compression.none`` or ``.fp16`` (or their names).
        backward_passes_per_step: apply (and communicate) every N-th call; gradients are summed locally.
        average_aggregated_gradients: divide the N summed gradients by N.
        op: ``hvd.Average`` (default), ``hvd.Sum`` or ``hvd.Adasum``.
        num_groups, groups: Horovod's: how many allreduce calls the gradients go in, or lists of
            variables reduced together (``num_groups`` is the old spelling of an int ``groups``).
        scale_local_gradients: divide the gradients of variables given to ``register_local_var``
            (kept local, not reduced) by the size, as Horovod.
        shard: None (default), ``"optimizer"`` (ZeRO-1), ``"gradients"`` (ZeRO-2) or ``"parameters"``
            (ZeRO-3: then ``model = opt.shard_model(model)``): returns a
            :class:`dualframe.tensorflow.dp.shard.optimizer.ShardedOptimizer`, whose state covers 1/N of the parameters
            (with loss scaling: a :class:`dualframe.tensorflow.dp.shard.precision.ShardedLossScaleOptimizer` around it).
        scatter: with ``shard`` only: ``"auto"``, ``"reducescatter"`` or ``"allreduce"`` (how gradients reach
            their owners); refused without ``shard``, as in torch.

    Example:
        >>> hvd.init()                                                     # doctest: +SKIP
        >>> opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.01 * hvd.size()))  # doctest: +SKIP
        >>> model.compile(optimizer=opt, loss="mse")                       # doctest: +SKIP
        >>> model.fit(x, y, callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])  # doctest: +SKIP
    """

    def __new__(cls, optimizer: Any = None, *args: Any, **kwargs: Any) -> Any:
        if cls is not DistributedOptimizer:  # a subclass (or the class optimizer_subclass made)
            return super().__new__(cls)
        named = _given_arguments(optimizer, args, kwargs)
        shard = named.get("shard")
        if check_shard(shard) is not None:
            given = {k: named.pop(k) for k in ("num_groups", "groups", "scale_local_gradients") if k in named}
            if given and given != {k: _DEFAULTS[k] for k in given}:
                raise StrategyError(f"shard={shard!r} reduces by buckets of its own: leave out {', '.join(given)}")
            if wants_loss_scaling(optimizer):
                from dualframe.tensorflow.dp.shard.precision import sharded_loss_scale

                return sharded_loss_scale(optimizer, **named)
            from dualframe.tensorflow.dp.shard.optimizer import ShardedOptimizer

            return ShardedOptimizer(optimizer, **named)
        check_scatter(named.get("scatter"), None)  # scatter= without shard=: refused before anything
        if "keep_gathered" in named:
            refuse_zero3_only("keep_gathered", shard)
        if wants_loss_scaling(optimizer):
            named.pop("shard", None), named.pop("scatter", None)
            return DistributedLossScaleOptimizer.wrap(optimizer, **named)
        if isinstance(optimizer, keras.optimizers.Optimizer) and not isinstance(optimizer, _WRAPPERS):
            # (anything else __init__ refuses by name)
            cls = optimizer_subclass(cls, type(optimizer))
        return super().__new__(cls)

    def __init__(self, optimizer: keras.optimizers.Optimizer, name: Optional[str] = None,
                 device_dense: str = "", device_sparse: str = "", compression: Any = Compression.none,
                 sparse_as_dense: bool = False, gradient_predivide_factor: float = 1.0, op: Any = hvd.Average,
                 backward_passes_per_step: int = 1, average_aggregated_gradients: bool = False,
                 num_groups: int = 0, groups: Any = None, process_set: Any = hvd.global_process_set,
                 scale_local_gradients: bool = True, *, shard: Optional[str] = None,
                 scatter: Optional[str] = None) -> None:
        settings, accumulation = wrap_settings(
            optimizer, compression, op, sparse_as_dense, gradient_predivide_factor, backward_passes_per_step,
            average_aggregated_gradients, process_set, device_dense, device_sparse, groups, num_groups)
        check_bool("scale_local_gradients", scale_local_gradients)
        # The Keras base's constructor, not the wrapped class's (its arguments are unknown here).
        keras.optimizers.Optimizer.__init__(self, learning_rate=0.0, name=name or f"distributed_{optimizer.name}")
        self.inner_optimizer = optimizer
        self.reduction = settings
        self.accumulation = accumulation
        self.scale_local_gradients = scale_local_gradients
        self._local_vars: Dict[int, Any] = {}

    def register_local_var(self, var: Any) -> None:
        """Keep ``var``'s gradient local: it is not reduced across ranks (Horovod's ``register_local_var``)."""
        self._local_vars[id(var)] = var

    def build(self, var_list: Sequence[Any]) -> None:
        """Build the inner optimizer (unless built) and the accumulators."""
        if not self.inner_optimizer.built:
            self.inner_optimizer.build(var_list)
        self.accumulation.build(self, var_list)
        keras.optimizers.Optimizer.build(self, var_list)

    @property
    def variables(self) -> List[Any]:
        """This wrapper's variables, then the inner optimizer's (the order every rank broadcasts)."""
        return list(keras.optimizers.Optimizer.variables.fget(self)) + list(  # type: ignore[attr-defined]
            self.inner_optimizer.variables)

    def apply(self, grads: Sequence[Any], trainable_variables: Optional[Sequence[Any]] = None) -> None:
        """Reduce ``grads`` across ranks (every N-th call) and let the inner optimizer apply them."""
        if trainable_variables is not None and not self.built:
            self.build(list(trainable_variables))
        variables = list(trainable_variables) if trainable_variables is not None \
            else self.accumulation.trainable_variables
        self.accumulation.step(list(grads), lambda g: self.inner_optimizer.apply(self._reduce(g, variables),
                                                                                  variables))

    def _reduce(self, grads: List[Any], variables: List[Any]) -> List[Any]:
        if not self._local_vars:
            return reduce_gradients(grads, self.reduction, variables)
        shared = [i for i, v in enumerate(variables) if id(v) not in self._local_vars]
        out = list(grads)
        for i, g in zip(shared, reduce_gradients([grads[i] for i in shared], self.reduction,
                                                 [variables[i] for i in shared])):
            out[i] = g
        if self.scale_local_gradients:
            size = float(self.reduction.process_set.size())
            out = [g / size if i not in shared and g is not None else g for i, g in enumerate(out)]
        return out

    def apply_gradients(self, grads_and_vars: Any) -> Any:
        """``apply`` on (gradient, variable) pairs; returns the inner optimizer's iterations."""
        grads, variables = zip(*grads_and_vars)
        self.apply(grads, variables)
        return self.iterations

    @property
    def learning_rate(self) -> Any:
        return self.inner_optimizer.learning_rate

    @learning_rate.setter
    def learning_rate(self, learning_rate: Any) -> None:
        # The base constructor sets a placeholder rate before inner_optimizer exists.
        if "inner_optimizer" in self.__dict__:
            self.inner_optimizer.learning_rate = learning_rate
        else:
            keras.optimizers.Optimizer.learning_rate.fset(self, learning_rate)  # type: ignore[attr-defined]

    @property
    def iterations(self) -> Any:
        return self.inner_optimizer.iterations

    def scale_loss(self, loss: Any) -> Any:
        return self.inner_optimizer.scale_loss(loss)

    def finalize_variable_values(self, var_list: Sequence[Any]) -> None:
        self.inner_optimizer.finalize_variable_values(var_list)

    def get_config(self) -> Dict[str, Any]:
        return {"name": self.name, "optimizer": keras.saving.serialize_keras_object(self.inner_optimizer),
                **_config(self.reduction, self.accumulation)}

    @classmethod
    def from_config(cls, config: Dict[str, Any], custom_objects: Any = None) -> "DistributedOptimizer":
        config = dict(config)
        inner = keras.saving.deserialize_keras_object(config.pop("optimizer"), custom_objects=custom_objects)
        return getattr(cls, "wrapper_class", cls)(inner, **config)  # type: ignore[no-any-return]


@keras.saving.register_keras_serializable(package="dualframe")
class DistributedLossScaleOptimizer(KerasTwoNames, keras.optimizers.LossScaleOptimizer):
    """A LossScaleOptimizer that reduces the (scaled) gradients across ranks before its finite check.

    ``compile`` keeps it as it is (it already is a LossScaleOptimizer), and since every rank checks
    the same reduced gradients, all ranks skip or apply a step together.

    Example:
        >>> keras.mixed_precision.set_global_policy("mixed_float16")                # doctest: +SKIP
        >>> opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.01))  # -> this class  doctest: +SKIP
    """

    def __init__(self, inner_optimizer: keras.optimizers.Optimizer, initial_scale: float = 2.0 ** 15,
                 dynamic_growth_steps: int = 2000, name: Optional[str] = None, compression: Any = Compression.none,
                 sparse_as_dense: bool = False, gradient_predivide_factor: float = 1.0, op: Any = hvd.Average,
                 backward_passes_per_step: int = 1, average_aggregated_gradients: bool = False,
                 process_set: Any = None, device_dense: str = "", device_sparse: str = "", num_groups: int = 0,
                 groups: Any = None, scale_local_gradients: bool = True) -> None:
        settings, accumulation = wrap_settings(
            inner_optimizer, compression, op, sparse_as_dense, gradient_predivide_factor, backward_passes_per_step,
            average_aggregated_gradients, process_set, device_dense, device_sparse, groups, num_groups)
        check_bool("scale_local_gradients", scale_local_gradients)  # no local variables here: nothing to scale
        super().__init__(inner_optimizer, initial_scale=initial_scale, dynamic_growth_steps=dynamic_growth_steps,
                         name=name or f"distributed_loss_scale_{inner_optimizer.name}")
        self.reduction = settings
        self.accumulation = accumulation

    @classmethod
    def wrap(cls, optimizer: keras.optimizers.Optimizer, name: Optional[str] = None, device_dense: str = "",
             device_sparse: str = "", **kwargs: Any) -> "DistributedLossScaleOptimizer":
        """From DistributedOptimizer's arguments: keep a LossScaleOptimizer's settings, or add one."""
        if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
            check_wrappable(optimizer)
            return cls(optimizer.inner_optimizer, optimizer.initial_scale, optimizer.dynamic_growth_steps,
                       name=name, device_dense=device_dense, device_sparse=device_sparse, **kwargs)
        return cls(optimizer, name=name, device_dense=device_dense, device_sparse=device_sparse, **kwargs)

    def build(self, var_list: Sequence[Any]) -> None:
        super().build(var_list)
        self.accumulation.build(self, var_list)

    def apply(self, grads: Sequence[Any], trainable_variables: Optional[Sequence[Any]] = None) -> None:
        """Reduce the scaled gradients (every N-th call), then check, unscale and apply them."""
        if trainable_variables is not None and not self.built:
            self.build(list(trainable_variables))
        apply_scaled = super().apply
        self.accumulation.step(list(grads), lambda g: apply_scaled(
            reduce_gradients(g, self.reduction, trainable_variables), trainable_variables))

    def get_config(self) -> Dict[str, Any]:
        return {**super().get_config(), **_config(self.reduction, self.accumulation)}


_WRAPPERS = (DistributedOptimizer, DistributedLossScaleOptimizer)
_SIGNATURE = inspect.signature(DistributedOptimizer.__init__)
_DEFAULTS = {name: p.default for name, p in _SIGNATURE.parameters.items()}


def _given_arguments(optimizer: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Dict[str, Any]:
    """DistributedOptimizer's arguments (past ``optimizer``) by name, positional ones included.

    Keywords it does not know pass through (the sharded optimizer takes more; the others refuse them).

    Raises:
        TypeError: too many positional arguments, as Python would say.
    """
    extra = {k: v for k, v in kwargs.items() if k not in _DEFAULTS}  # ShardedOptimizer's own (bucket_elements)
    known = {k: v for k, v in kwargs.items() if k in _DEFAULTS}
    bound = _SIGNATURE.bind(None, optimizer, *args, **known).arguments
    return {**{k: v for k, v in bound.items() if k not in ("self", "optimizer")}, **extra}
