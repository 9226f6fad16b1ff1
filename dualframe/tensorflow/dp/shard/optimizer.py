"""ZeRO-1/2/3 for Keras 3: ``DistributedOptimizer(shard=...)``, an optimizer whose state covers this rank's slice of the parameters.

The cut is the core's :class:`dualframe.dp.shard.ShardLayout`; this module moves the bytes. Per bucket
the gradients are flattened, concatenated, zero-padded and reduce-scattered (one grouped Horovod
reducescatter), a copy of the user's optimizer (same class and config) updates one flat slice
variable per bucket, so its slot variables (Adam's m and v, SGD's momentum) hold 1/N of the state,
and the updated slices are allgathered back into the model's variables.

``shard="optimizer"`` (ZeRO-1) accumulates ``backward_passes_per_step`` passes in full-size buffers and
communicates once per step, as the plain wrapper does. ``shard="gradients"`` (ZeRO-2) reduce-scatters
every pass and accumulates only the rank's slice, so no full-size gradient outlives its backward pass.
(Keras's tape returns every gradient before the optimizer runs, so within one pass the full gradient
exists in both modes; ZeRO-2 saves the accumulators and lets each bucket's flat copy go once scattered.)
``shard="parameters"`` (ZeRO-3) steps as ZeRO-2 but never writes the model back: the slices are the
parameters, and ``dualframe.tensorflow.dp.shard.parameters`` gathers them for each step.

How the gradients reach the slices is ``dp/shard/gradients.py``; the state in the plain optimizer's
layout (saving, loading, bytes held) is ``dp/shard/state_dict.py``.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

import keras
import numpy as np
import tensorflow as tf
from keras import ops

from dualframe.dp.shard import (BUCKET_ELEMENTS, ShardLayout, check_same_parameters, check_scatter, check_shard,
                                parameter_signature)
from dualframe.dp.zero3 import check_keep_gathered, refuse_zero3_only
from dualframe.errors import StrategyError
from dualframe.tensorflow.collectives import hvd
from dualframe.tensorflow.dp.shard import parameters as sharded_parameters
from dualframe.tensorflow.dp.compression import Compression
from dualframe.tensorflow.dp.gradients import SHARD_SCOPE, collective_scope, named
from dualframe.tensorflow.dp.optimizer import KerasTwoNames, _config, register_wrapper, wrap_settings
from dualframe.tensorflow.dp.shard.gradients import SliceGradients
from dualframe.tensorflow.dp.shard.slices import SLICE_NAME, ShardedState, check_elementwise, inner_copy
from dualframe.tensorflow.dp.shard.state_dict import PlainState

@keras.saving.register_keras_serializable(package="dualframe")
class ShardedOptimizer(SliceGradients, PlainState, KerasTwoNames, keras.optimizers.Optimizer):
    """Data parallelism with the optimizer state (ZeRO-1), also the gradients (ZeRO-2) or also the parameters (ZeRO-3) sharded.

    With ``shard="parameters"`` the model must go through :meth:`shard_model` (or ``hvd.distribute`` with
    ``DataParallel(shard="parameters")``), which returns the model to train; see
    :mod:`dualframe.tensorflow.dp.shard.parameters`.

    Made by ``hvd.DistributedOptimizer(optimizer, shard="optimizer" | "gradients")`` and used as the
    plain wrapper is: ``model.compile(optimizer=...)`` then ``fit``, or ``opt.apply(grads, vars)`` /
    ``apply_gradients`` in a GradientTape loop. Final weights equal plain data parallelism's.

    The optimizer must update every element from that element's gradient and state alone (SGD, Adam,
    AdamW, Adamax, Nadam, RMSprop, Adagrad, Adadelta, Ftrl, Lion); per-tensor norms or shapes (Lamb,
    Adafactor, Muon), ``clipnorm``, ``use_ema`` and ``exclude_from_weight_decay`` are refused.
    ``global_clipnorm`` works: the norm is the square root of the allreduced sum of every rank's slice
    norm squared, applied before the update as Keras applies it. ``variables`` lists only what every rank holds alike (iterations, learning rate, the
    ZeRO-1 accumulators), so ``BroadcastGlobalVariablesCallback`` leaves each rank's slice alone; the
    slices are :meth:`shard_variables`. Saving (``model.save``, ``save_own_variables``) gathers the
    state in the plain optimizer's layout, so EVERY rank must call ``model.save`` (rank 0 keeps the file).

    Args:
        optimizer: the Keras optimizer to shard (only its class and config are used).
        shard: ``"optimizer"`` (ZeRO-1), ``"gradients"`` (ZeRO-2) or ``"parameters"`` (ZeRO-3).
        bucket_elements: largest flat bucket in elements (default 4M: 16 MiB of float32; None: one bucket
            per dtype). Keep buckets well under 32 MiB on CPU: glibc serves larger blocks with a fresh
            mmap each time, and every temporary of the update then pays page faults (a 67 MiB bucket made
            Adam's update 4x slower than on the separate variables).
        keep_gathered: ``shard="parameters"`` only (default 1): the model's last ``keep_gathered`` layers
            holding variables keep their gathered values from their forward to their backward, which then
            neither gathers again nor recomputes their call (each costs its full values and inner
            activations in memory meanwhile; 0: every layer gathered again and recomputed).
        Other arguments: as ``DistributedOptimizer``; ``op`` must be Average or Sum.

    Example:
        >>> opt = hvd.DistributedOptimizer(keras.optimizers.Adam(1e-3), shard="optimizer")  # doctest: +SKIP
        >>> model.compile(optimizer=opt, loss="mse")                                         # doctest: +SKIP
        >>> model.fit(x, y, callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])   # doctest: +SKIP
        >>> opt.state_bytes()   # this rank's slot bytes: about 1/N of Adam's                # doctest: +SKIP
    """

    def __init__(self, optimizer: keras.optimizers.Optimizer, name: Optional[str] = None,
                 device_dense: str = "", device_sparse: str = "", compression: Any = Compression.none,
                 sparse_as_dense: bool = False, gradient_predivide_factor: float = 1.0, op: Any = hvd.Average,
                 backward_passes_per_step: int = 1, average_aggregated_gradients: bool = False,
                 process_set: Any = None, shard: str = "optimizer",
                 bucket_elements: Optional[int] = BUCKET_ELEMENTS,
                 scatter: str = "auto", keep_gathered: Optional[int] = None) -> None:
        settings, accumulation = wrap_settings(
            optimizer, compression, op, sparse_as_dense, gradient_predivide_factor, backward_passes_per_step,
            average_aggregated_gradients, process_set, device_dense, device_sparse)
        mode = check_shard(shard, settings.op)
        if mode is None:
            raise StrategyError("ShardedOptimizer needs shard='optimizer', 'gradients' or 'parameters'; for "
                                "shard=None use hvd.DistributedOptimizer")
        check_elementwise(optimizer)
        scatter = check_scatter(scatter, mode)  # type: ignore[assignment]
        if keep_gathered is not None and mode != "parameters":
            refuse_zero3_only("keep_gathered", shard)
        keep = check_keep_gathered(1 if keep_gathered is None else keep_gathered)
        ShardLayout.build([], 1, bucket_elements=bucket_elements)  # checks bucket_elements now, not at build
        super().__init__(learning_rate=0.0, name=name or f"sharded_{optimizer.name}")
        self.shard = mode
        self.keep_gathered = keep  # ZeRO-3: how many of the model's last layers keep their values to their backward
        self.bucket_elements = bucket_elements
        self.scatter = scatter
        self.reduction = settings
        self.accumulation = accumulation
        # A plain holder: the Keras optimizer tracks Variables and optimizers set as attributes, and the
        # saver walks them; the slices and the inner optimizer differ per rank, so neither may be tracked.
        inner, self.global_clipnorm_value = inner_copy(optimizer)
        self._zero = ShardedState(inner)

    # --- building: the cross-rank check, the layout, the slices and the inner optimizer's slots -----------------
    def build(self, var_list: Sequence[Any]) -> None:
        """Cut the parameters and build the inner optimizer on this rank's slices (no communication).

        The cross-rank check that every rank holds the same parameters runs at the first ``apply``
        (when every rank steps or traces its step), so building stays local: an elastic worker
        that joins builds its optimizer while the others wait in ``sync``. Built once: a later call (``fit``
        after a manual ``build``, or ``build`` twice) on the same variables (or, ZeRO-3, on the slices)
        keeps the slices and slots as they are.

        Raises:
            StrategyError: ZeRO-3 before ``shard_model``, or built already on other variables.
        """
        variables = list(var_list)
        if self.built:
            self._zero.check_built_on(variables)
            return
        if self.shard == "parameters" and self._zero.values is None:
            raise StrategyError(
                "shard='parameters' keeps only this rank's slice of the model's values, so the model must be "
                "sharded first: model = opt.shard_model(model), or model = hvd.distribute(model, "
                "dualframe.DataParallel(shard='parameters'))")
        ranks = self.reduction.process_set.size()
        with tf.init_scope():
            layout = self._zero.planned or ShardLayout.build(
                [int(np.prod(v.shape)) for v in variables], ranks, dtypes=[str(v.dtype) for v in variables],
                bucket_elements=self.bucket_elements)
            self._zero.build(layout, variables, self.reduction.process_set.rank(), self._zero.values)
            if self.shard == "parameters":
                self._zero.values = []  # the full values go: from now on the slices are the parameters
            if self.shard != "optimizer":
                self._build_slice_accumulators()
        if self.shard == "optimizer":
            self.accumulation.build(self, variables)
        # ZeRO-3's model variables have no values, and Keras keys the variables it builds on by their values'
        # handles; this wrapper never updates them itself (the inner optimizer updates the slices).
        super().build([] if self.shard == "parameters" else variables)

    def reshard(self) -> None:
        """Cut the state again for the process set's current size (an elastic job resized; no communication).

        The slot values are dropped: load the full state next (``load_state_arrays``), as
        ``hvd.elastic.KerasState.sync`` does. A traced train step keeps the old slices: drop it (the
        elastic state's ``reset`` does).
        """
        if self.shard == "parameters":
            raise StrategyError("shard='parameters' cannot be re-cut for a resized job (the slices are the only "
                                "copy of the parameters); save_weights, then load them on the new job")
        zero = self._zero
        self._zero = ShardedState(type(zero.inner).from_config(zero.inner.get_config()))
        with tf.init_scope():
            layout = ShardLayout.build(list(zero.layout.sizes) if zero.layout else [],
                                       self.reduction.process_set.size(),
                                       dtypes=[str(v.dtype) for v in zero.variables],
                                       bucket_elements=self.bucket_elements)
            self._zero.build(layout, zero.variables, self.reduction.process_set.rank())
            if self.shard != "optimizer":
                self._build_slice_accumulators()

    def recheck(self) -> None:
        """Check again, at the next ``apply``, that every rank holds the same parameters (after an elastic sync)."""
        self._zero.checked = False

    def sharded_for(self) -> int:
        """The number of ranks the current slices were cut for (0 before ``build``)."""
        return self._zero.layout.ranks if self._zero.layout is not None else 0

    def _check_same_everywhere(self, variables: List[Any], ranks: int) -> None:
        """The one collective before a refusal: every rank gathers every rank's signature and raises alike."""
        signature = parameter_signature([(v.name, tuple(v.shape), str(v.dtype)) for v in variables])
        if ranks == 1:
            return
        mine = tf.constant([[signature, len(variables)]], dtype=tf.int64)
        gathered = hvd.allgather(mine, process_set=self.reduction.process_set).numpy()
        check_same_parameters([int(s) for s in gathered[:, 0]], [int(c) for c in gathered[:, 1]])

    def _build_slice_accumulators(self) -> None:
        zero = self._zero
        if self.accumulation.steps > 1:
            zero.buffers = [keras.Variable(tf.zeros_like(s), trainable=False, name=f"{SLICE_NAME}{b}_accumulated")
                            for b, s in enumerate(zero.slices)]
            zero.counter = keras.Variable(0, dtype="int32", trainable=False, name="dualframe_backward_passes")

    # --- one step --------------------------------------------------------------------------------------------------
    def apply(self, grads: Sequence[Any], trainable_variables: Optional[Sequence[Any]] = None) -> None:
        """Reduce-scatter ``grads`` (every pass with ZeRO-2, every N-th with ZeRO-1), update the slice, allgather."""
        if self.shard == "parameters":
            self._apply_to_slices(list(grads), trainable_variables)
            return
        if trainable_variables is not None and not self.built:
            self.build(list(trainable_variables))
        grads = list(grads)
        self._zero.check_variables(grads, trainable_variables)
        self._check_once()
        if self.shard == "optimizer":
            self.accumulation.step(grads, lambda g: self._update(self._reduce_scatter(g)))
        else:
            self._sliced_step(self._reduce_scatter(grads))

    def _check_once(self) -> None:
        if not self._zero.checked:
            with tf.init_scope():  # eager even while fit traces the step: every rank raises alike, now
                self._check_same_everywhere(self._zero.variables, self.reduction.process_set.size())
            self._zero.checked = True

    def _apply_to_slices(self, grads: List[Any], variables: Optional[Sequence[Any]]) -> None:
        """ZeRO-3: the gradients of :meth:`parameter_slices`, already reduced by each layer's backward."""
        zero = self._zero
        if zero.model is None or variables is None or not zero.are_slices(variables):
            raise StrategyError(
                "shard='parameters': the model's own variables hold no values; shard it (model = "
                "opt.shard_model(model)), then apply the gradients of opt.parameter_slices(): slices = "
                "opt.parameter_slices(); opt.apply(tape.gradient(loss, slices), slices); fit does this")
        self._check_once()
        self._sliced_step([tf.zeros_like(s) if g is None else g for g, s in zip(grads, zero.slices)])

    def apply_gradients(self, grads_and_vars: Any) -> Any:
        """``apply`` on (gradient, variable) pairs; returns the inner optimizer's iterations."""
        grads, variables = zip(*grads_and_vars)
        self.apply(grads, variables)
        return self.iterations

    def _sliced_step(self, slice_grads: List[Any]) -> None:
        """Update the slices with reduced ``slice_grads`` (every N-th call; accumulated in slices till then)."""
        zero, steps = self._zero, self.accumulation.steps
        if steps == 1:
            self._update(slice_grads)
            return
        for buffer, piece in zip(zero.buffers, slice_grads):
            buffer.assign_add(piece)
        zero.counter.assign_add(1)

        def boundary() -> None:
            scale = 1.0 / steps if self.accumulation.average else 1.0
            self._update([ops.convert_to_tensor(b) * scale for b in zero.buffers])
            for buffer in zero.buffers:
                buffer.assign(ops.zeros_like(buffer))
            zero.counter.assign(0)

        ops.cond(ops.equal(zero.counter, steps), boundary, lambda: None)

    def _update(self, slice_grads: List[tf.Tensor]) -> None:
        if self._zero.guard is None:
            self._step_slices(slice_grads)
        else:  # a ShardedLossScaleOptimizer: unscale, and step on every rank or on none
            self._zero.guard(slice_grads, self._step_slices)

    def _step_slices(self, slice_grads: List[tf.Tensor]) -> None:
        zero = self._zero
        if self.shard != "parameters":
            zero.load_slices()  # the model may have been set, loaded or broadcast since the last step
        zero.inner.apply(self._clip(slice_grads), zero.slices)
        if self.shard == "parameters":
            return  # the slices are the parameters; the next step gathers them
        values = [tf.convert_to_tensor(s) for s in zero.slices]
        if self.reduction.process_set.size() > 1:
            with collective_scope(SHARD_SCOPE):
                values = list(hvd.grouped_allgather(named(values, "slice"), process_set=self.reduction.process_set))
        zero.write_back(values)

    # --- what the rest of Keras sees -------------------------------------------------------------------------------
    @property
    def variables(self) -> List[Any]:
        """What every rank holds alike: this wrapper's variables and the inner optimizer's non-slot ones."""
        return list(super().variables) + self._zero.replicated_variables()

    # --- ZeRO-3 (shard="parameters"): the model's values are the slices -------------------------------------------
    def shard_model(self, model: keras.Model, root_rank: int = 0) -> keras.Model:
        """A copy of ``model`` holding no values, trained from this optimizer's slices of ``root_rank``'s values.

        See :mod:`dualframe.tensorflow.dp.shard.parameters`. Fit the returned model (compile it with this
        optimizer) or, in a GradientTape loop, differentiate with respect to :meth:`gather`'s tensors.
        """
        return sharded_parameters.shard_model(self, model, root_rank)

    def parameter_slices(self) -> List[Any]:
        """ZeRO-3: this rank's slices of the parameters, what a GradientTape loop differentiates and applies to.

        Their gradients come out of the tape already reduced (each layer's backward reduce-scatters), so
        ``opt.apply(tape.gradient(loss, slices), slices)`` only updates them.
        """
        return list(self._zero.slices)

    @property
    def learning_rate(self) -> Any:
        return self._zero.inner.learning_rate

    @learning_rate.setter
    def learning_rate(self, learning_rate: Any) -> None:
        if "_zero" in self.__dict__:
            self._zero.inner.learning_rate = learning_rate
        else:  # the base constructor sets a placeholder before the inner optimizer exists
            keras.optimizers.Optimizer.learning_rate.fset(self, learning_rate)  # type: ignore[attr-defined]

    @property
    def iterations(self) -> Any:
        return self._zero.inner.iterations

    def get_config(self) -> Dict[str, Any]:
        inner = keras.saving.serialize_keras_object(self._zero.inner)
        inner["config"]["global_clipnorm"] = self.global_clipnorm_value  # the user's optimizer, as given
        return {"name": self.name, "optimizer": inner,
                "shard": self.shard, "bucket_elements": self.bucket_elements, "scatter": self.scatter,
                **({"keep_gathered": self.keep_gathered} if self.shard == "parameters" else {}),
                **_config(self.reduction, self.accumulation)}

    @classmethod
    def from_config(cls, config: Dict[str, Any], custom_objects: Any = None) -> "ShardedOptimizer":
        config = dict(config)
        inner = keras.saving.deserialize_keras_object(config.pop("optimizer"), custom_objects=custom_objects)
        return cls(inner, **config)


register_wrapper(ShardedOptimizer)
