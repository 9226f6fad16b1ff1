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

``backward_passes_per_step=k`` (as torch's stage): the k steps of an update sum their gradients in
full on each rank, the stage staying gathered between them; the k-th step reduces the sum once.
``compression=`` applies to that reduction (Horovod's compress and decompress around it).
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator, List, Optional, Sequence

import keras
import tensorflow as tf

from dualframe.dp.precision import master_dtype
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
        #: The full gradients summed over the steps of an update not yet applied (``backward_passes_per_step``).
        self._summed: Optional[List[Any]] = None
        self._passes = 0
        self._holds_values = False

    def __repr__(self) -> str:
        return f"DistributedOptimizer(shard='parameters', stage, {self._zero.inner!r})"

    def build(self, var_list: Sequence[Any]) -> None:
        """Cut the stage's current values into this rank's slices, build the inner optimizer on them, free the values.

        Built once (``distributed_optimizer`` builds it): a later call on the same variables (or on the slices)
        keeps the slices and slots as they are.

        Raises:
            StrategyError: built already on other variables.
        """
        variables = list(var_list)
        if self.built:
            self._zero.check_built_on(variables)
            return
        zero = self._zero
        zero.model = self  # fp32 master slices of float16 / bfloat16 variables (the slices are the only copy)
        with tf.init_scope():
            assert zero.planned is not None
            zero.build(zero.planned, variables, self.reduction.process_set.rank())
        super(ShardedOptimizer, self).build([])  # the inner optimizer steps the slices; the wrapper holds no slots
        open_shapes(variables)
        self.free()

    def begin_step(self) -> None:
        """Write every variable's full value, allgathered from the replicas' slices in one grouped call.

        A stage still gathered (an update's steps under way, ``backward_passes_per_step``) is left as it is.
        """
        if self._holds_values:
            return
        zero = self._zero
        values = [tf.convert_to_tensor(s) for s in zero.slices]
        if self.reduction.process_set.size() > 1:
            with collective_scope(SHARD_SCOPE):
                values = list(hvd.grouped_allgather(named(values, "stage_parameter"),
                                                    process_set=self.reduction.process_set))
        for variable, value in zip(zero.variables, zero.unflatten(values)):
            variable._value.assign(tf.cast(value, variable.dtype))
        self._holds_values = True

    def free(self) -> None:
        """Empty every trainable variable of the stage (zero-size placeholders) until the next ``begin_step``."""
        for variable in self._zero.variables:
            if variable.shape.rank:
                variable._value.assign(tf.zeros([0] * variable.shape.rank, variable.dtype))
        self._holds_values = False

    def end_inference(self) -> None:
        """After an inference walk: free the stage, unless an update's steps are under way (they keep it)."""
        if not self._passes:
            self.free()

    def reload(self) -> None:
        """Take this rank's slices of the values just written into the stage's variables, then free them."""
        self._zero.load_slices()
        self.free()

    def apply(self, grads: Sequence[Any], trainable_variables: Optional[Sequence[Any]] = None) -> None:
        """Reduce the step's summed ``grads`` into this rank's slices, free the full values, update the slices.

        With ``backward_passes_per_step=k`` the first k - 1 calls only add ``grads`` to the update's sum
        (the stage stays gathered: its values do not change till the update); the k-th reduces the sum.
        """
        grads = list(grads)
        self._zero.check_variables(grads, trainable_variables)
        self._check_once()
        summed = self._accumulated(grads)
        del grads
        if summed is None:
            return
        slice_grads = self._reduce_scatter(summed)
        del summed
        self.free()
        self._update(slice_grads)

    def _accumulated(self, grads: List[Any]) -> Optional[List[Any]]:
        """``grads``, or every k-th call the k steps' sum (divided by k with ``average_aggregated_gradients``)."""
        steps = self.accumulation.steps
        if steps == 1:
            return grads
        dense = [tf.cast(g, master_dtype(g.dtype.name)) for g in self._zero.dense(grads)]  # float16: summed in float32
        self._summed = dense if self._summed is None else [a + g for a, g in zip(self._summed, dense)]
        self._passes += 1
        if self._passes < steps:
            return None
        summed, self._summed, self._passes = self._summed, None, 0
        return [g / steps for g in summed] if self.accumulation.average else summed

    def state_arrays(self) -> List[Any]:
        """The plain optimizer's state, gathered (every replica calls); refused within an update's steps.

        Raises:
            StrategyError: some of an update's ``backward_passes_per_step`` steps ran (their summed gradients
                are no state a checkpoint keeps), the same on every replica.
        """
        if self._passes:
            raise StrategyError(f"the stage's optimizer is {self._passes} of {self.accumulation.steps} steps into "
                                f"an update (backward_passes_per_step); save after the update's last step")
        return super().state_arrays()

    @contextlib.contextmanager
    def gathered(self) -> Iterator[None]:
        """The stage's full values in its variables inside (a collective on the replica set), freed after.

        A stage gathered already (an update's steps under way) stays gathered.
        """
        held = self._holds_values
        self.begin_step()
        try:
            yield
        finally:
            if not held:
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

