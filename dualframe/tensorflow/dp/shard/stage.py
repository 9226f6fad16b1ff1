"""ZeRO-3 among a Keras pipeline stage's replicas: the stage gathered once per step, its gradients reduced once per step.

A process pipeline's stage runs ``chunks`` micro-batches per step through compiled passes that read
the stage's variables. Gathering each layer inside every micro-batch's forward and backward, as the
plain Keras ZeRO-3 does (``dualframe.tensorflow.dp.shard.layers``), would move the stage's values
``2 x chunks`` times per step. Here, as in torch's ``StageShardedOptimizer``: at the step's start one
grouped allgather on the stage's replica set writes every variable's full value; the step's
micro-batches run as unsharded; the step's summed gradients are reduced once (averaged among the
replicas) into each rank's slice; the full values are freed and the slice updated.

Freeing: each trainable variable's ``tf.Variable`` is made with every dimension open
(``shape=[None] * rank``; the Keras variable keeps its full ``shape``), so between steps it holds a
zero-size placeholder and its buffer goes back to TensorFlow's allocator (reused for the next
step's activations; on a CPU the process's resident size does not shrink, the allocator keeps the
pages). Between steps a rank holds 1/R of the stage's trainable values (float32 master slices) and
the optimizer state of its slices only (R: the stage's replicas); within a step, the stage's full
values and summed gradients, as ZeRO-2 would. Non-trainable variables (batch-norm statistics) stay
whole on every replica, as in plain data parallelism.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional, Sequence

import keras
import tensorflow as tf

from dualframe.errors import StrategyError
from dualframe.tensorflow.collectives import hvd
from dualframe.tensorflow.dp.gradients import SHARD_SCOPE, collective_scope, named
from dualframe.tensorflow.dp.shard.layers import layers_plan
from dualframe.tensorflow.dp.shard.optimizer import ShardedOptimizer


class OpenVariable(keras.Variable):  # type: ignore[misc]
    """A Keras variable whose ``tf.Variable`` has open dimensions: emptied between steps, read with its full shape.

    Its reads (``__tf_tensor__``, how TensorFlow ops take a Keras variable) carry the Keras ``shape``, so a
    traced pass infers the same static shapes as with a plain variable (an einsum needs them).
    """

    def __tf_tensor__(self, dtype: Any = None, name: Any = None) -> Any:
        tensor = super().__tf_tensor__(dtype, name)
        tensor.set_shape(self.shape)
        return tensor


def open_shapes(variables: Sequence[Any]) -> None:
    """Give each Keras variable a ``tf.Variable`` of open dimensions (same value, dtype, name) to free between steps.

    Raises:
        StrategyError: a variable of another class than Keras's TensorFlow one (it could not be emptied).
    """
    for variable in variables:
        if type(variable) not in (keras.Variable, OpenVariable):
            raise StrategyError(f"shard='parameters' in a pipeline stage empties Keras's TensorFlow variables between "
                                f"steps; {variable.path} is a {type(variable).__name__}: use shard='gradients'")
        old = variable._value
        if old.shape.rank == 0 or type(variable) is OpenVariable:
            continue  # a scalar stays whole (no dimension to empty); already open
        variable._value = tf.Variable(old, shape=tf.TensorShape([None] * old.shape.rank), dtype=old.dtype,
                                      trainable=old.trainable, name=old.name.split(":")[0])
        variable.__class__ = OpenVariable


def _nbytes(value: Any) -> int:
    """Bytes ``value`` holds now (an open-shaped variable: its current value's, not its declared shape's)."""
    return int(tf.size(value)) * tf.as_dtype(value.dtype).size


class StageShardedOptimizer(ShardedOptimizer):
    """A Keras pipeline stage's optimizer with ``shard="parameters"``: 1/R of the stage's values between steps.

    Built by ``DistributedPipeline.distributed_optimizer(opt, shard="parameters")`` on a pipeline with
    replicas (``data_parallel`` > 1): ``process_set`` is the stage's replica set. The pipeline calls
    ``begin_step`` before each walk, :meth:`free` after an inference walk, and ``apply_gradients``
    reduces the step's gradients, frees the full values and updates this rank's slices.
    ``pipe.get_weights``, ``gather_weights``, ``set_weights`` and stage checkpoints use the unsharded
    layout (the stage's replicas gather first: every rank calls them).

    Example:
        >>> pipe = hvd.DistributedPipeline(model, [3, 2], chunks=4, loss_fn="mse", data_parallel=2)  # doctest: +SKIP
        >>> opt = pipe.distributed_optimizer(keras.optimizers.Adam(1e-3), shard="parameters")      # doctest: +SKIP
        >>> loss = pipe.train_step(x, y); pipe.apply_gradients(opt)                                  # doctest: +SKIP
        >>> opt.held_bytes()   # about 1/R of the stage's values and Adam's state                   # doctest: +SKIP

    Raises:
        StrategyError: as ``ShardedOptimizer``; the stage's layers not built.
    """

    def __init__(self, optimizer: keras.optimizers.Optimizer, layers: Sequence[Any], variables: Sequence[Any],
                 process_set: Any, **kwargs: Any) -> None:
        if not all(layer.built for layer in layers):
            raise StrategyError("shard='parameters' cuts the stage's values at once: build the model first (give "
                                "the keras.Sequential a keras.Input)")
        super().__init__(optimizer, process_set=process_set, shard="parameters", **kwargs)
        self._zero.planned, self._zero.blocks = layers_plan(layers, variables, process_set.size(),
                                                           self.bucket_elements)
        self.stage_variables = list(variables)

    def __repr__(self) -> str:
        return f"DistributedOptimizer(shard='parameters', stage, {self._zero.inner!r})"

    def build(self, var_list: Sequence[Any]) -> None:
        """Cut the stage's current values into this rank's slices, build the inner optimizer on them, free the values."""
        variables = list(var_list)
        zero = self._zero
        zero.model = self  # fp32 master slices of float16 / bfloat16 variables (the slices are the only copy)
        with tf.init_scope():
            assert zero.planned is not None
            zero.build(zero.planned, variables, self.reduction.process_set.rank())
        super(ShardedOptimizer, self).build([])  # the inner optimizer steps the slices; the wrapper holds no slots
        open_shapes(variables)
        self.free()

    def begin_step(self) -> None:
        """Write every variable's full value, allgathered from the replicas' slices in one grouped call."""
        zero = self._zero
        values = [tf.convert_to_tensor(s) for s in zero.slices]
        if self.reduction.process_set.size() > 1:
            with collective_scope(SHARD_SCOPE):
                values = list(hvd.grouped_allgather(named(values, "stage_parameter"),
                                                    process_set=self.reduction.process_set))
        for variable, value in zip(zero.variables, zero.unflatten(values)):
            variable._value.assign(tf.cast(value, variable.dtype))

    def free(self) -> None:
        """Empty every trainable variable of the stage (zero-size placeholders) until the next ``begin_step``."""
        for variable in self._zero.variables:
            if variable.shape.rank:
                variable._value.assign(tf.zeros([0] * variable.shape.rank, variable.dtype))

    def reload(self) -> None:
        """Take this rank's slices of the values just written into the stage's variables, then free them."""
        self._zero.load_slices()
        self.free()

    def apply(self, grads: Sequence[Any], trainable_variables: Optional[Sequence[Any]] = None) -> None:
        """Reduce the step's summed ``grads`` into this rank's slices, free the full values, update the slices."""
        grads = list(grads)
        self._zero.check_variables(grads, trainable_variables)
        self._check_once()
        slice_grads = self._reduce_scatter(grads)
        del grads
        self.free()
        self._update(slice_grads)

    @contextlib.contextmanager
    def gathered(self) -> Iterator[None]:
        """The stage's full values in its variables inside (a collective on the replica set), freed after."""
        self.begin_step()
        try:
            yield
        finally:
            self.free()

    def held_bytes(self) -> int:
        """Bytes this rank holds for the stage's trainable values: the variables' storage, slices, optimizer state."""
        held = [v._value for v in self._zero.variables] + list(self._zero.slices) + self._zero.slot_variables()
        return sum(_nbytes(v) for v in held)

    def full_bytes(self) -> int:
        """Bytes the same stage holds unsharded: its trainable values and the optimizer's slots for each."""
        slots = len(self._zero.slot_names())
        full = sum(v.shape.num_elements() * tf.as_dtype(v.dtype).size for v in self.stage_variables)
        return int(full) * (1 + slots)

