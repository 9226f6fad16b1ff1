"""Keras process pipelines trained the Keras way (compile, fit, evaluate, predict) on 4 processes, against ``fit`` of the unsplit model.

Loss scaling (mixed_float16 layers, a ``LossScaleOptimizer`` given or added by ``compile`` under the policy):
losses and weights equal ``fit`` of the unsplit model within float16's tolerance, the same scale on every
rank; an overflowing step skipped on every rank (the last stage's own gradients finite), the scale halved.

A functional model split over 4 processes (4 stages) and over 2 replicas x 2 stages: per-epoch losses,
metrics and validation logs, EarlyStopping's stop, ReduceLROnPlateau's rate, ModelCheckpoint's saved
model and the final weights equal ``keras.Model.fit`` in one process (float32, 1e-5), with SGD and
Adam, also compiled with ``distributed_optimizer(opt, shard="gradients" | "parameters")`` (ZeRO-2 / ZeRO-3
among a stage's replicas); logs equal on every rank; one rank's stop stops all; BackupAndRestore resumes at the epoch;
bad input refused on every rank before any step.
"""
import os
# np: 4
# timeout: 400
import keras
import numpy as np
import pytest

import dualframe.tensorflow as hvd
from dualframe.errors import ChunksError, DataError, StrategyError
from dualframe.tensorflow.pipeline.precision import PipelineLossScaleOptimizer
from dualframe.pipeline.layout import pipeline_process_sets
# tests/parallel is on sys.path (pytest rootdir import)
from keras_pipeline_models import assert_weights

SETS = pipeline_process_sets(4, 4, graph=True)
hvd.init(process_sets=SETS + [s for s in pipeline_process_sets(4, 2) if s not in SETS])
LAYOUTS = {"4 stages": dict(split_points=["t1", "d2", "d3"]), "2 x 2": dict(split_points=["d2"], data_parallel=2),
           # 2 replicas of 2 ranks, each rank 2 stages of the V (rank 0 holds the first and the last)
           "2 x 2 x 2 zb-v": dict(split_points=["t1", "d2", "d3"], data_parallel=2, virtual_stages=2, schedule="zb-v")}
OPTIMIZERS = {"sgd": lambda: keras.optimizers.SGD(0.1, momentum=0.9), "adam": lambda: keras.optimizers.Adam(0.01)}


def make_model(dtype=None):
    """A seeded functional MLP: d1 -> tanh -> d2 -> relu -> d3 (5 features in, 2 out); ``dtype`` for all but d3 (float32)."""
    keras.utils.set_random_seed(3)
    x = keras.Input((5,), name="x")
    h = keras.layers.Activation("tanh", name="t1", dtype=dtype)(keras.layers.Dense(12, name="d1", dtype=dtype)(x))
    h = keras.layers.Activation("relu", name="t2", dtype=dtype)(keras.layers.Dense(12, name="d2", dtype=dtype)(h))
    return keras.Model(x, keras.layers.Dense(2, name="d3", dtype="float32" if dtype else None)(h))


def data(rows, seed):
    rng = np.random.RandomState(seed)
    return rng.randn(rows, 5).astype("float32"), rng.randn(rows, 2).astype("float32")


def callbacks(path):
    """EarlyStopping that stops after epoch 3 (no gain of 10), the learning rate halved after epoch 2, the best model saved."""
    return [keras.callbacks.EarlyStopping(monitor="loss", min_delta=10.0, patience=2),
            keras.callbacks.ReduceLROnPlateau(monitor="loss", min_delta=10.0, patience=1, factor=0.5),
            keras.callbacks.ModelCheckpoint(path, monitor="val_loss", save_best_only=True)]


def shared_folder(tmp_path):
    return hvd.broadcast_object(str(tmp_path), 0, name="fit.folder")


def check_fit_equals_keras_fit(pipe, optimizer, name, tmp_path):
    """``pipe.fit`` (compiled with ``optimizer``) against ``keras.Model.fit`` of the unsplit model: logs, weights, saved model."""
    folder = shared_folder(tmp_path)
    (x, y), validation = data(64, 1), data(32, 2)
    arguments = dict(batch_size=16, epochs=5, shuffle=False, validation_data=validation, verbose=0)
    reference = make_model()
    reference.compile(OPTIMIZERS[name](), loss="mse", metrics=["mae"])
    want = reference.fit(x, y, callbacks=callbacks(os.path.join(folder, f"one-{hvd.rank()}.keras")), **arguments)

    pipe.compile(optimizer, loss="mse", metrics=["mae"])  # dualframe: same compile
    got = pipe.fit(x, y, callbacks=callbacks(os.path.join(folder, "pipe.keras")), **arguments)

    assert len(want.history["loss"]) == 3, "EarlyStopping should stop the reference after epoch 3"
    assert want.history["learning_rate"][-1] == pytest.approx(want.history["learning_rate"][0] / 2)
    histories = hvd.allgather_object(got.history, name=f"fit.{name}.history")
    assert all(h == histories[0] for h in histories), f"histories differ between ranks: {histories}"
    assert sorted(got.history) == sorted(want.history), (got.history, want.history)
    for key, values in want.history.items():
        assert got.history[key] == pytest.approx(values, abs=1e-5), f"rank {hvd.rank()}: {key}"
    assert_weights(pipe.gather_weights(), reference.get_weights(), "final weights vs keras fit")
    saved = keras.models.load_model(os.path.join(folder, "pipe.keras"))  # written once, by rank 0
    best = keras.models.load_model(os.path.join(folder, f"one-{hvd.rank()}.keras"))
    assert_weights(saved.get_weights(), best.get_weights(), "ModelCheckpoint's model vs keras fit's")


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_fit_equals_keras_fit_of_the_unsplit_model(layout, optimizer, tmp_path):
    pipe = hvd.DistributedPipeline(make_model(), chunks=4, **LAYOUTS[layout])  # dualframe: the split
    for variable in pipe.trainable_variables if pipe.replica == 1 else []:  # fit starts from replica 0's weights
        variable.assign(variable + 1.0)
    check_fit_equals_keras_fit(pipe, OPTIMIZERS[optimizer](), optimizer, tmp_path)


@pytest.mark.parametrize("shard, optimizer", [("gradients", "adam"), ("parameters", "sgd"), ("parameters", "adam")])
def test_fit_with_a_sharded_stage_optimizer_equals_keras_fit(shard, optimizer, tmp_path):
    """compile takes ``distributed_optimizer(opt, shard=...)`` as it is: ZeRO-2 / ZeRO-3 among each stage's 2 replicas."""
    pipe = hvd.DistributedPipeline(make_model(), chunks=4, **LAYOUTS["2 x 2"])
    sharded = pipe.distributed_optimizer(OPTIMIZERS[optimizer](), shard=shard)  # dualframe: ZeRO-2 / ZeRO-3
    check_fit_equals_keras_fit(pipe, sharded, optimizer, tmp_path)
    assert pipe.optimizer is sharded, "compile wrapped distributed_optimizer's result again"
    if shard == "parameters":  # between steps each replica keeps its half of the stage's values and state
        padding = 64  # each layer's slices padded to a multiple of the replicas: an element or so per copy
        assert pipe.sharded is sharded and sharded.held_bytes() <= 0.5 * sharded.full_bytes() + padding


def test_evaluate_and_predict_equal_the_unsplit_model():
    x, y = data(48, 4)
    reference = make_model()
    reference.compile("sgd", loss="mse", metrics=["mae"])
    pipe = hvd.DistributedPipeline(make_model(), chunks=2, **LAYOUTS["2 x 2"])
    pipe.compile("sgd", loss="mse", metrics=["mae"])
    want = reference.evaluate(x, y, batch_size=12, verbose=0, return_dict=True)
    got = pipe.evaluate(x, y, batch_size=12, verbose=0, return_dict=True)
    assert got == pytest.approx(want, abs=1e-5)
    outputs = pipe.predict(x, batch_size=12, verbose=0, all_ranks=True)  # every rank, replicas' shares in order
    np.testing.assert_allclose(outputs, reference.predict(x, batch_size=12, verbose=0), atol=1e-5)
    last = pipe.predict(x, batch_size=12, verbose=0)
    assert (last is not None) == pipe.is_last


class StopHere(keras.callbacks.Callback):
    """Asks to stop after batch 1 on one rank only: fit must stop every rank there."""

    def on_train_batch_end(self, batch, logs=None):
        if batch == 1 and hvd.rank() == 2:
            self.model.stop_training = True


def test_a_stop_asked_on_one_rank_stops_every_rank_at_that_batch():
    pipe = hvd.DistributedPipeline(make_model(), chunks=2, **LAYOUTS["2 x 2"])
    pipe.compile("sgd", loss="mse")
    history = pipe.fit(*data(64, 7), batch_size=8, epochs=3, verbose=0, callbacks=[StopHere()])
    steps = hvd.allgather_object((len(history.history["loss"]), pipe._compiled.steps), name="fit.stop")
    assert steps == [(1, 2)] * 4, f"epochs and steps per rank: {steps}"


def test_bad_input_is_refused_on_every_rank_before_any_step():
    pipe = hvd.DistributedPipeline(make_model(), chunks=4, **LAYOUTS["2 x 2"])
    pipe.compile("sgd", loss="mse")
    before = pipe.get_weights()
    x, y = data(64 if hvd.rank() != 3 else 48, 5)  # rank 3's input is shorter
    with pytest.raises(DataError, match="every rank must pass the same data"):
        pipe.fit(x, y, batch_size=16, verbose=0)
    x, y = data(64, 5)
    with pytest.raises(ChunksError, match="fewer than chunks=4"):  # 8-row batches: 4 rows per replica, the last 2
        pipe.fit(x[:60], y[:60], batch_size=8, verbose=0)
    with pytest.raises(DataError, match="validation_split"):
        pipe.fit(x, y, batch_size=16, validation_split=0.99, verbose=0)  # no training rows left
    rank = hvd.rank() == 1  # one rank's bad argument fails everywhere
    with pytest.raises(DataError, match="refused on rank 1"):
        pipe.fit(x, y, batch_size=16, validation_split=2.0 if rank else 0.25, verbose=0)
    assert_weights(pipe.get_weights(), before, "weights after refused fits", atol=0)


class Interrupt(keras.callbacks.Callback):
    """Stops a run after epoch ``epoch`` with an error, as a crash would (on every rank alike)."""

    def __init__(self, epoch):
        super().__init__()
        self.epoch = epoch

    def on_epoch_end(self, epoch, logs=None):
        if epoch == self.epoch:
            raise RuntimeError("interrupted")


@pytest.mark.parametrize("layout", ["2 x 2", "2 x 2 x 2 zb-v"])
def test_backup_and_restore_resumes_at_the_epoch_with_the_optimizer_state(layout, tmp_path):
    """A dataset of unknown length, Adam, a learning-rate schedule; a run cut after epoch 2 resumes there."""
    import tensorflow as tf

    folder = shared_folder(tmp_path)
    x, y = data(64, 6)
    known = tf.data.Dataset.from_tensor_slices((x, y)).batch(16)
    dataset = known.filter(lambda *_: True)  # unknown cardinality: the ranks agree after each batch
    schedule = lambda: keras.callbacks.LearningRateScheduler(lambda epoch, lr: 0.02 * 0.5 ** epoch)  # noqa: E731
    reference = make_model()
    reference.compile(keras.optimizers.Adam(), loss="mse")
    # Keras 3.15 itself steps its optimizer 20 times in 4 epochs of 4 batches of unknown cardinality: its
    # reference reads the same batches with their number known.
    want = reference.fit(known, epochs=4, callbacks=[schedule()], verbose=0).history["loss"]

    backup = os.path.join(folder, "backup")
    pipe = hvd.DistributedPipeline(make_model(), chunks=2, **LAYOUTS[layout])
    pipe.compile(keras.optimizers.Adam(), loss="mse")
    with pytest.raises(RuntimeError, match="interrupted"):
        pipe.fit(dataset, epochs=4, verbose=0, callbacks=[keras.callbacks.BackupAndRestore(backup), schedule(),
                                                          Interrupt(1)])
    pipe = hvd.DistributedPipeline(make_model(), chunks=2, **LAYOUTS[layout])  # a fresh start, weights from scratch
    pipe.compile(keras.optimizers.Adam(), loss="mse")
    log = os.path.join(folder, f"log-{hvd.rank()}.csv")
    got = pipe.fit(dataset, epochs=4, verbose=0, callbacks=[keras.callbacks.BackupAndRestore(backup), schedule(),
                                                            keras.callbacks.CSVLogger(log)]).history
    assert got["loss"] == pytest.approx(want[2:], abs=1e-5), "epochs 3 and 4 after resuming"
    assert_weights(pipe.gather_weights(), reference.get_weights(), "resumed vs keras fit")
    written = hvd.allgather_object(os.path.exists(log), name=f"fit.{layout}.csv")
    reporter = 0 if "zb-v" in layout else 1  # zb-v's last stage is on the pipeline's first rank
    assert written == [rank == reporter for rank in range(4)], "CSVLogger writes on the last stage of replica 0 only"


def loss_scaled(initial_scale=2.0 ** 15):
    return keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1, momentum=0.9), initial_scale=initial_scale)


@pytest.mark.parametrize("layout", ["4 stages", "2 x 2"])
@pytest.mark.parametrize("given", ["LossScaleOptimizer", "mixed_float16 policy"])
def test_loss_scaled_fit_equals_keras_fit_of_the_unsplit_model(layout, given):
    """4 stages: t1's stage has no weights and still takes its part in each step's decision."""
    (x, y), arguments = data(64, 8), dict(batch_size=16, epochs=2, shuffle=False, verbose=0)
    policy = keras.mixed_precision.global_policy()
    try:
        if given == "LossScaleOptimizer":
            reference, pipe_model, optimizer = make_model("mixed_float16"), make_model("mixed_float16"), loss_scaled
        else:  # compile adds the LossScaleOptimizer, as keras.Model.compile does
            keras.mixed_precision.set_global_policy("mixed_float16")
            reference, pipe_model = make_model(), make_model()
            optimizer = lambda: keras.optimizers.SGD(0.1, momentum=0.9)  # noqa: E731
        reference.compile(optimizer(), loss="mse")
        want = reference.fit(x, y, **arguments).history["loss"]
        pipe = hvd.DistributedPipeline(pipe_model, chunks=4, **LAYOUTS[layout])
        pipe.compile(optimizer(), loss="mse")
        got = pipe.fit(x, y, **arguments).history["loss"]
    finally:
        keras.mixed_precision.set_global_policy(policy)
    assert isinstance(pipe.optimizer, PipelineLossScaleOptimizer)
    assert isinstance(reference.optimizer, keras.optimizers.LossScaleOptimizer)
    assert got == pytest.approx(want, abs=2e-3), f"rank {hvd.rank()}: losses {got} vs keras {want}"
    assert_weights(pipe.gather_weights(), reference.get_weights(), "loss-scaled fit vs keras fit", atol=2e-3)
    scales = hvd.allgather_object(float(pipe.optimizer.dynamic_scale), name=f"fit.scale.{layout}.{given}")
    assert scales == [float(reference.optimizer.dynamic_scale)] * 4, scales


@pytest.mark.parametrize("shard", [None, "optimizer"])
def test_an_overflowing_step_is_skipped_on_every_rank_and_the_scale_halved(shard):
    """A scale of 2**120: the last stage's float32 gradients stay finite, the float16 ones before it overflow."""
    x, y = data(16, 9)
    pipe = hvd.DistributedPipeline(make_model("mixed_float16"), chunks=4, split_points=["d3"], data_parallel=2,
                                   loss_fn="mse")
    optimizer = pipe.distributed_optimizer(loss_scaled(2.0 ** 120), **({"shard": shard} if shard else {}))
    reference = make_model("mixed_float16")
    reference.compile(loss_scaled(2.0 ** 120), loss="mse")
    want = reference.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0).history["loss"]
    before = pipe.get_weights()
    rows = slice(8 * pipe.replica, 8 * pipe.replica + 8)
    loss = pipe.train_step(x[rows] if pipe.is_first else None, y[rows] if pipe.is_last else None)
    finite = all(bool(np.all(np.isfinite(g))) for g in pipe.gradients if g is not None)
    pipe.apply_gradients(optimizer)
    assert finite == pipe.is_last, f"rank {hvd.rank()}: finite gradients {finite}"
    assert loss == pytest.approx(want[0], abs=2e-3)
    assert_weights(pipe.get_weights(), before, "weights after a skipped step", atol=0)
    assert float(optimizer.dynamic_scale) == float(reference.optimizer.dynamic_scale) == 2.0 ** 119
    assert int(optimizer.step_counter) == 0 and int(optimizer.iterations) == 0


def test_a_loss_scale_optimizer_the_pipeline_did_not_make_is_refused():
    x, y = data(16, 9)
    pipe = hvd.DistributedPipeline(make_model("mixed_float16"), chunks=2, loss_fn="mse", **LAYOUTS["4 stages"])
    pipe.train_step(x if pipe.is_first else None, y if pipe.is_last else None)
    with pytest.raises(StrategyError, match="never scaled"):
        pipe.apply_gradients(loss_scaled())
