"""``compile``, ``fit``, ``evaluate`` and ``predict`` of ``keras.Model`` on a Keras process pipeline (``DistributedPipeline``).

Every rank calls them with the same arguments. The ranks first agree on the data (one allgather:
the same input and batches everywhere, every batch big enough, else the same ``DataError`` on every
rank before any step); each step then runs ``train_step`` on the replica's share of the global batch
and the compiled optimizer. The loss every rank gets back from the pipeline makes the training logs,
so they are equal on every rank; evaluation sums the last stages' loss and metric states over the
replicas and hands the result to every rank. Callbacks: ``pipeline_callbacks``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import keras
import numpy as np
import tensorflow as tf
from keras.src.trainers.data_adapters import data_adapter_utils

from dualframe.errors import DataError, StrategyError
from dualframe.pipeline.fit_plan import check_same
from dualframe.tensorflow.collectives import hvd
from dualframe.tensorflow.functions import broadcast_variables
from dualframe.tensorflow.pipeline.callbacks import (PipelineModel, agree_stop, decides_per_batch, is_reporter,
                                                     rank_callbacks)
from dualframe.tensorflow.pipeline.data import PipelineData, replica_share, split_validation
from dualframe.tensorflow.pipeline.losses import MeteredLoss, keras_loss, keras_metric, use_loss
from dualframe.tensorflow.pipeline.precision import PipelineLossScaleOptimizer, ScaledLoss, unscaled


@dataclass
class Compiled:
    """What ``compile`` set: the optimizer (averaged among a stage's replicas) and the metrics."""

    optimizer: Any
    loss: Callable[[Any, Any], Any]
    metrics: List[keras.metrics.Metric] = field(default_factory=list)
    loss_tracker: keras.metrics.Mean = field(default_factory=lambda: keras.metrics.Mean(name="loss"))
    steps: int = 0  #: training steps run so far (the same on every stage, unlike a weightless stage's optimizer)


def _verbose(verbose: Any) -> int:
    return 1 if verbose == "auto" else int(verbose)


class KerasFit:
    """``keras.Model``'s training API on a ``DistributedPipeline``: the script of a plain Keras model, run on every rank.

    Example:
        >>> pipe = hvd.DistributedPipeline(model, stages=2, chunks=4)               # doctest: +SKIP
        >>> pipe.compile(keras.optimizers.Adam(1e-3), loss="mse", metrics=["mae"])  # doctest: +SKIP
        >>> history = pipe.fit(x, y, batch_size=64, epochs=5, validation_split=0.1,
        ...                    callbacks=[keras.callbacks.EarlyStopping(patience=2)])  # doctest: +SKIP
    """

    _compiled: Optional[Compiled] = None

    @property
    def optimizer(self) -> Any:
        """The compiled optimizer (wrapped to average among the stage's replicas in a hybrid), None before ``compile``."""
        return self._compiled.optimizer if self._compiled is not None else None

    def compile(self, optimizer: Any = "rmsprop", loss: Any = None, metrics: Optional[Sequence[Any]] = None) -> None:
        """Set the optimizer, the loss (else the constructor's ``loss_fn``) and the metrics, as ``keras.Model.compile``.

        The optimizer steps the stage's own variables; with replicas it is wrapped by
        ``distributed_optimizer``, unless it is one that ``distributed_optimizer`` returned: that one is
        taken as it is (``shard=`` among the stage's replicas, ZeRO-3 included). Under the ``mixed_float16``
        policy (the model's, else the global one) a plain optimizer gets a ``LossScaleOptimizer`` as
        ``keras.Model.compile`` adds one; with one, the pipeline scales its loss and every rank skips an
        overflowing step together (``pipeline.precision``). Metrics are computed on the last stage, in training from each
        micro-batch's outputs as the loss is (``MeteredLoss``); their states are summed over the
        replicas after each batch (one allgather per step with metrics, none without), so a metric's
        state must add up over rows (means, sums, counts, confusion matrices).

        Raises:
            StrategyError: no loss here nor in the constructor, an unknown loss name, or a ``shard="parameters"``
                stage optimizer under the ``mixed_float16`` policy (its loss would need a scale it cannot take).
        """
        pipe: Any = self
        if loss is None and pipe.loss_fn is None:
            raise StrategyError("compile needs a loss: pass loss= here or loss_fn= to DistributedPipeline")
        base = keras_loss(loss) if loss is not None else unscaled(pipe.loss_fn)
        base = base.loss if isinstance(base, MeteredLoss) else base
        chosen = [keras_metric(m) for m in metrics or []]
        use_loss(pipe, MeteredLoss(base, chosen) if chosen else base)
        policy = pipe.keras_model.dtype_policy if pipe.keras_model is not None else keras.mixed_precision.global_policy()
        if any(optimizer is m for m in pipe.made_optimizers):
            if optimizer is pipe.sharded and policy.name == "mixed_float16":
                raise StrategyError("compile under the mixed_float16 policy scales the loss (as keras.Model.compile "
                                    "does), which a shard='parameters' stage optimizer cannot do yet: use "
                                    "mixed_bfloat16 (no loss scale needed) or shard='gradients'")
            if isinstance(optimizer, PipelineLossScaleOptimizer):  # the loss just set, scaled by it again
                use_loss(pipe, ScaledLoss(pipe.loss_fn, optimizer))
            self._compiled = Compiled(optimizer, base, chosen)
            return
        optimizer = keras.optimizers.get(optimizer)
        if policy.name == "mixed_float16" and not isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
            optimizer = keras.optimizers.LossScaleOptimizer(optimizer)  # as keras.Model.compile (auto_scale_loss)
        self._compiled = Compiled(pipe.distributed_optimizer(optimizer), base, chosen)

    def _needs_compile(self, what: str) -> Compiled:
        if self._compiled is None:
            raise StrategyError(f"call compile(optimizer, loss) before {what}()")
        return self._compiled

    def _name(self, what: str) -> str:
        pipe: Any = self
        return f"{pipe.role.link.prefix}.fit.{what}"

    def _agree_has(self, has_batch: bool) -> bool:
        """Whether every rank has another batch of an input of unknown length (a collective); mixed: DataError."""
        flags = hvd.allgather_object(bool(has_batch), name=self._name("has_batch"))
        if all(flags) or not any(flags):
            return bool(flags[0])
        raise DataError(f"the input ran out on ranks {[r for r, f in enumerate(flags) if not f]} but not on ranks "
                        f"{[r for r, f in enumerate(flags) if f]}: every rank must pass data of the same length")

    def _plan(self, what: str, build: Callable[[], List[PipelineData]], extra: Dict[str, Any]) -> List[PipelineData]:
        """Build the inputs on every rank and agree on them before any step (one allgather).

        A rank whose arguments fail to build tells the others through the same allgather, so every
        rank raises the same error instead of waiting.
        """
        pipe: Any = self
        seed = 0
        described: Dict[str, Any] = {"call": what, **extra}
        datas: List[PipelineData] = []
        try:
            datas = build()
            if any(d.shuffle for d in datas):  # rank 0's draw shuffles on every rank (numpy's stream, as Keras's)
                seed = int(np.random.randint(2 ** 31 - 1))
            described.update((f"{i}.{k}", v) for i, d in enumerate(datas) for k, v in d.describe().items())
            error = None
        except Exception as failure:  # whatever Keras's adapters raise: every rank must hear of it
            error = f"{type(failure).__name__}: {failure}"
        gathered = hvd.allgather_object((error, described, seed), name=self._name("plan"))
        for rank, (refusal, _, _) in enumerate(gathered):
            if refusal is not None:
                raise DataError(f"{what} refused on rank {rank}: {refusal}")
        check_same([g[1] for g in gathered], f"DistributedPipeline.{what}")
        for data in datas:
            data.seed = gathered[0][2]
            data.check(pipe.grid.replicas, pipe.chunks, what)
        return datas

    def _same_start(self) -> None:
        """Replicas of a stage start from replica 0's weights, as Horovod's BroadcastGlobalVariablesCallback does.

        So a script need not seed its model alike on every rank: each stage's layers are its own, and
        the replicas of a stage get the same ones here (a broadcast among the stage's replicas). With a
        ``shard="parameters"`` optimizer the trainable values are its replicas' slices, cut from replica 0's
        values when it was made: only the other variables are broadcast here.
        """
        pipe: Any = self
        if pipe.grid.replicas == 1:
            return
        sliced = {id(v) for v in pipe.sharded.stage_variables} if pipe.sharded is not None else set()
        whole = [v for v in pipe.variables if id(v) not in sliced]
        if whole:
            broadcast_variables(whole, root_rank=pipe.stage_ranks[0], process_set=pipe.stage_process_set)

    def _share(self, batch: Tuple[Any, Any], what: str) -> Tuple[Any, Any, int]:
        """This rank's part of a global batch: its replica's rows, inputs on the first stage, targets on the last."""
        pipe: Any = self
        x, y = replica_share(batch, pipe.replica, pipe.grid.replicas, pipe.chunks, what)
        rows = int(keras.tree.flatten(batch[0])[0].shape[0])
        return (x if pipe.is_first else None), (y if pipe.is_last else None), rows

    def _callbacks(self, callbacks: Any, verbose: int, epochs: int, steps: Optional[int]) -> Tuple[Any, PipelineModel]:
        model = PipelineModel(self, list(callbacks or []))
        mine = rank_callbacks(self, model, callbacks)
        listed = keras.callbacks.CallbackList(mine, add_history=True, add_progbar=verbose != 0 and is_reporter(self),
                                              model=model, verbose=verbose, epochs=epochs, steps=steps)
        return listed, model

    def _train_batch(self, batch: Tuple[Any, Any], compiled: Compiled) -> Dict[str, float]:
        pipe: Any = self
        x, y, rows = self._share(batch, "a training batch")
        loss = pipe.train_step(x, y)
        # A stage of weightless layers (an activation) has nothing to step, but takes its part in the loss scale's decision
        if pipe.trainable_variables or isinstance(compiled.optimizer, PipelineLossScaleOptimizer):
            pipe.apply_gradients(compiled.optimizer)
        compiled.steps += 1
        compiled.loss_tracker.update_state(loss, sample_weight=rows)
        logs = {"loss": float(compiled.loss_tracker.result())}
        if compiled.metrics:  # the last stages' states, summed over the replicas (a collective)
            logs.update(self._shared_logs(compiled.metrics))
        return logs

    def fit(self, x: Any = None, y: Any = None, batch_size: Optional[int] = None, epochs: int = 1,
            verbose: Any = "auto", callbacks: Optional[Sequence[Any]] = None, validation_split: float = 0.0,
            validation_data: Any = None, shuffle: bool = True, initial_epoch: int = 0,
            steps_per_epoch: Optional[int] = None, validation_steps: Optional[int] = None,
            validation_batch_size: Optional[int] = None, validation_freq: int = 1) -> keras.callbacks.History:
        """Train as ``keras.Model.fit`` does, on every rank with the same arguments; returns the ``History``.

        Logs and History are equal on every rank. One progress bar, on the last stage of replica 0.

        Raises:
            DataError, ChunksError: inputs that differ between ranks, a batch that does not split into
                the replicas' shares of at least ``chunks`` rows, a ``validation_split`` that cannot be
                honoured; on every rank before any step.
        """
        self._needs_compile("fit")  # a pipeline never compiled is refused here

        def build() -> List[PipelineData]:
            train, val = (x, y), validation_data
            if validation_split and validation_data is None:
                train, val = split_validation(x, y, validation_split)
            datas = [PipelineData(*train, batch_size, steps_per_epoch, shuffle, 0, self._agree_has)]
            if val is not None:
                vx, vy, _ = data_adapter_utils.unpack_x_y_sample_weight(val)
                datas.append(PipelineData(vx, vy, validation_batch_size or batch_size, validation_steps, False, 0,
                                          self._agree_has))
            return datas

        datas = self._plan("fit", build, {"epochs": epochs, "initial_epoch": initial_epoch,
                                          "validation_freq": validation_freq})
        self._same_start()
        listed, model = self._callbacks(callbacks, _verbose(verbose), epochs, datas[0].num_batches)
        per_batch = decides_per_batch(callbacks)
        listed.on_train_begin()
        logs: Dict[str, float] = {}
        for epoch in range(model._initial_epoch or initial_epoch, epochs):
            logs = self._fit_epoch(epoch, datas, listed, model, per_batch, validation_freq)
            if model.stop_training:
                break
        listed.on_train_end(logs=logs)
        return model.history

    def _fit_epoch(self, epoch: int, datas: List[PipelineData], listed: Any, model: PipelineModel, per_batch: bool,
                   validation_freq: int) -> Dict[str, float]:
        compiled = self._needs_compile("fit")
        for metric in [compiled.loss_tracker] + compiled.metrics:
            metric.reset_state()
        listed.on_epoch_begin(epoch)
        logs: Dict[str, float] = {}
        for step, batch in enumerate(datas[0].epoch(epoch)):
            listed.on_train_batch_begin(step)
            logs = self._train_batch(batch, compiled)
            listed.on_train_batch_end(step, logs)
            if per_batch:
                model.stop_training = agree_stop(model.stop_training, self._name("stop_batch"))
            if model.stop_training:
                break
        logs = dict(logs)
        if len(datas) > 1 and (epoch + 1) % validation_freq == 0:
            logs.update((f"val_{k}", v) for k, v in self._evaluate(datas[1], listed).items())
        listed.on_epoch_end(epoch, logs)
        model.stop_training = agree_stop(model.stop_training, self._name("stop"))
        return logs

    def evaluate(self, x: Any = None, y: Any = None, batch_size: Optional[int] = None, verbose: Any = "auto",
                 steps: Optional[int] = None, callbacks: Optional[Sequence[Any]] = None,
                 return_dict: bool = False) -> Any:
        """The loss and metrics over the data, as ``keras.Model.evaluate``, equal on every rank."""
        self._needs_compile("evaluate")
        datas = self._plan("evaluate", lambda: [PipelineData(x, y, batch_size, steps, False, 0, self._agree_has)],
                           {})
        listed, _ = self._callbacks(callbacks, _verbose(verbose), 1, datas[0].num_batches)
        logs = self._evaluate(datas[0], listed)
        return logs if return_dict else (list(logs.values()) if len(logs) > 1 else logs["loss"])

    def _evaluate(self, data: PipelineData, listed: Any) -> Dict[str, float]:
        pipe: Any = self
        compiled = self._needs_compile("evaluate")
        states = [keras.metrics.Mean(name="loss")] + compiled.metrics
        for metric in states:
            metric.reset_state()
        listed.on_test_begin()
        logs: Dict[str, float] = {}
        for step, batch in enumerate(data.epoch(0)):
            listed.on_test_batch_begin(step)
            x, y, rows = self._share(batch, "an evaluation batch")
            outputs = pipe(x)
            if pipe.is_last:
                states[0].update_state(tf.reduce_mean(compiled.loss(y, outputs)), sample_weight=rows // pipe.grid.replicas)
                for metric in compiled.metrics:
                    metric.update_state(y, outputs)
            logs = self._shared_logs(states)
            listed.on_test_batch_end(step, logs)
        listed.on_test_end(logs)
        return logs

    def _shared_logs(self, metrics: Sequence[keras.metrics.Metric]) -> Dict[str, float]:
        """Each metric's result over every replica's rows, on every rank: the last stages' states summed (a collective)."""
        pipe: Any = self
        mine = [[np.asarray(v.numpy()) for v in m.variables] for m in metrics] if pipe.is_last else None
        parts = [s for _, s in sorted(hvd.allgather_object((pipe.replica, mine), name=self._name("metrics")),
                                      key=lambda part: part[0]) if s is not None]
        logs: Dict[str, float] = {}
        for k, metric in enumerate(metrics):
            own = [np.asarray(v.numpy()) for v in metric.variables]
            for v, values in zip(metric.variables, zip(*(part[k] for part in parts))):
                v.assign(np.sum(values, axis=0))
            result = metric.result()
            logs.update({name: float(value) for name, value in result.items()} if isinstance(result, dict)
                        else {metric.name: float(result)})
            for v, value in zip(metric.variables, own):
                v.assign(value)
        return logs

    def predict(self, x: Any, batch_size: Optional[int] = None, verbose: Any = "auto", steps: Optional[int] = None,
                callbacks: Optional[Sequence[Any]] = None, all_ranks: bool = False) -> Any:
        """The model's outputs for ``x``, as ``keras.Model.predict``: on the last stage of every replica, None elsewhere.

        ``all_ranks=True``: on every rank. Each replica predicts its share of each batch; the shares are
        gathered back in order.
        """
        pipe: Any = self
        datas = self._plan("predict", lambda: [PipelineData(x, None, batch_size, steps, False, 0,
                                                                 self._agree_has)], {"all_ranks": all_ranks})
        listed, _ = self._callbacks(callbacks, _verbose(verbose), 1, datas[0].num_batches)
        listed.on_predict_begin()
        outputs: List[Any] = []
        for step, batch in enumerate(datas[0].epoch(0)):
            listed.on_predict_batch_begin(step)
            inputs, _, _ = self._share(batch, "a prediction batch")
            out = pipe(inputs)
            if pipe.is_last:
                outputs.append(keras.tree.map_structure(lambda t: np.asarray(t), out))
            listed.on_predict_batch_end(step, {"outputs": out})
        listed.on_predict_end()
        if pipe.grid.replicas > 1 or all_ranks:
            gathered = hvd.allgather_object((pipe.replica, outputs if pipe.is_last else None), name=self._name("predict"))
            shares = [part for _, part in sorted(gathered, key=lambda g: g[0]) if part is not None]
            outputs = [_concat(list(batch)) for batch in zip(*shares)]
        if not (pipe.is_last or all_ranks) or not outputs:
            return None
        return _concat(outputs)


def _concat(parts: List[Any]) -> Any:
    """Concatenate along the rows a list of equally structured outputs (arrays, lists or dicts of arrays)."""
    return keras.tree.map_structure(lambda *arrays: np.concatenate(arrays, axis=0), *parts)
