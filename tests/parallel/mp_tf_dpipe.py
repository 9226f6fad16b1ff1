"""TensorFlow DistributedPipeline on 2 processes (one stage each), GPipe, 1F1B and ZB-H1, against one process training the whole model.
# timeout: 400
"""
import os

import horovod.tensorflow as horovod
import keras
import numpy as np
import pytest

import dualframe.tensorflow as hvd
from dualframe.errors import BalanceError, ChunksError, ScheduleError, StrategyError
from dualframe.tensorflow.pipeline.distributed import DistributedPipeline
# tests/parallel is on sys.path (pytest rootdir import)
from keras_pipeline_models import (assert_weights, batches, check_set_weights_and_inference, mlp, one_process,
                                   train_pipeline)

STEPS, BATCH, CHUNKS = 4, 10, 4  # micro-batches of 3, 3, 2, 2 rows
hvd.init()


def reference(data):
    """One process trains the whole model (the shared MLP, seed 7) on the same batches: losses and final weights."""
    return one_process(mlp(), data, keras.optimizers.SGD(0.1, momentum=0.9))


def test_started_on_two_processes():
    assert hvd.size() == 2


def test_bad_input_is_refused_on_every_rank_before_communication():
    mse, model = keras.losses.MeanSquaredError(), mlp()
    with pytest.raises(BalanceError, match=r"balance must sum to the number of layers \(balance: \[2, 2\] = 2 \+ 2 = 4, layers: 5\)"):
        DistributedPipeline(model, [2, 2], chunks=2, loss_fn=mse)
    with pytest.raises(StrategyError, match=r"multiple of the number of stages \(processes: 2, stages: 3\)"):
        DistributedPipeline(model, [2, 2, 1], chunks=2, loss_fn=mse)
    with pytest.raises(ChunksError, match=r"chunks must be an int >= 1 \(chunks: 0\)"):
        DistributedPipeline(model, [3, 2], chunks=0, loss_fn=mse)
    with pytest.raises(ScheduleError, match=r"unknown schedule 'zigzag'; choose one of gpipe, 1f1b"):
        DistributedPipeline(model, [3, 2], chunks=2, schedule="zigzag", loss_fn=mse)
    with pytest.raises(StrategyError, match=r"data_parallel x stages must equal the number of processes \(data_parallel: 2"):
        DistributedPipeline(model, [3, 2], chunks=2, loss_fn=mse, data_parallel=2)
    with pytest.raises(StrategyError, match=r"unknown Keras loss 'msq'"):
        DistributedPipeline(model, [3, 2], chunks=2, loss_fn="msq")


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
def test_training_equals_one_process(schedule):
    data = batches(STEPS, BATCH)
    expected_losses, expected_weights = reference(data)
    pipe = DistributedPipeline(mlp(), balance=[3, 2], chunks=CHUNKS, schedule=schedule,
                               loss_fn=keras.losses.MeanSquaredError())
    assert len(pipe.trainable_variables) == (4 if hvd.rank() == 0 else 2)
    train_pipeline(pipe, keras.optimizers.SGD(0.1, momentum=0.9), data, expected_losses)
    assert_weights(pipe.gather_weights(), expected_weights)
    assert pipe.records.records[-1].wall > 0
    # GPipe's steps after the first (eager) one run every micro-batch's W in one pass after the last B.
    tags = [tag for tag, _, _ in pipe.records.records[-1].actions]
    assert (tags[-CHUNKS:] == [f"W{i}" for i in reversed(range(CHUNKS))]) is (schedule == "gpipe")
    # Stage 0 holds all 4 micro-batches' tapes with GPipe, at most 2 with 1F1B and ZB-H1 (whose last stage
    # holds one micro-batch's kept gradients for W while the next one runs).
    assert pipe.peak_live == ({"gpipe": 4, "1f1b": 2, "zb-h1": 2}[schedule] if pipe.is_first
                              else {"gpipe": 4, "1f1b": 1, "zb-h1": 2}[schedule])


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
@pytest.mark.parametrize("checkpoint", ["always", "except_last"])
def test_checkpointed_stages_train_as_one_process(schedule, checkpoint):
    data = batches(STEPS, BATCH)
    expected_losses, expected_weights = reference(data)
    pipe = DistributedPipeline(mlp(), balance=[3, 2], chunks=CHUNKS, schedule=schedule, loss_fn="mse",
                               checkpoint=checkpoint)
    train_pipeline(pipe, keras.optimizers.SGD(0.1, momentum=0.9), data, expected_losses)
    assert_weights(pipe.gather_weights(), expected_weights)
    # Each micro-batch's W in its own backward: a batched W would keep every micro-batch's layer inputs.
    tags = [tag for tag, _, _ in pipe.records.records[-1].actions]
    assert tags[-CHUNKS:] != [f"W{i}" for i in reversed(range(CHUNKS))]


def dropout_model(seed=3):
    """Dense -> BatchNormalization -> Dropout | Dense -> relu -> Dropout -> Dense, seeded (balance [3, 4])."""
    init = keras.initializers.GlorotUniform
    return keras.Sequential([
        keras.Input((6,)), keras.layers.Dense(16, kernel_initializer=init(seed)), keras.layers.BatchNormalization(),
        keras.layers.Dropout(0.3, seed=seed), keras.layers.Dense(16, kernel_initializer=init(seed + 1)),
        keras.layers.Activation("relu"), keras.layers.Dropout(0.2, seed=seed + 1),
        keras.layers.Dense(3, kernel_initializer=init(seed + 2))])


@pytest.mark.parametrize("schedule", ["gpipe", "zb-h1"])
def test_checkpointing_replays_dropout_masks_and_updates_batch_norm_once(schedule):
    runs = {}
    for checkpoint in ("never", "always"):
        pipe = DistributedPipeline(dropout_model(), balance=[3, 4], chunks=CHUNKS, schedule=schedule, loss_fn="mse",
                                   checkpoint=checkpoint)
        optimizer, losses = keras.optimizers.SGD(0.1), []
        for x, y in batches(3, BATCH):
            losses.append(pipe.train_step(x, y))
            pipe.apply_gradients(optimizer)
        runs[checkpoint] = losses, pipe.gather_weights()  # moving statistics and Dropout's seed states included
    assert runs["always"][0] == pytest.approx(runs["never"][0], abs=1e-6)
    assert_weights(runs["always"][1], runs["never"][1], "checkpointed vs not", atol=1e-6)


def test_inference_and_set_weights_take_the_full_model():
    model, other = mlp(), mlp(seed=99)
    pipe = DistributedPipeline(model, balance=[3, 2], chunks=3, loss_fn="mse")
    check_set_weights_and_inference(pipe, other, rows=7)


def test_bad_batches_are_refused_on_every_rank():
    pipe = DistributedPipeline(mlp(), balance=[3, 2], chunks=4, loss_fn="mse")
    rng = np.random.RandomState(5)
    with pytest.raises(ChunksError, match=r"the batch is smaller than chunks \(batch: 3, chunks: 4\)"):
        pipe.train_step(rng.randn(3, 6).astype("float32"), rng.randn(3, 3).astype("float32"))
    with pytest.raises(StrategyError, match=r"the first stage of the pipeline got inputs=None"):
        pipe.train_step(None, rng.randn(8, 3).astype("float32"))
    with pytest.raises(ChunksError, match=r"targets must have one row per input row \(inputs: 8 rows, targets: 6 rows\)"):
        pipe.train_step(rng.randn(8, 6).astype("float32"), rng.randn(6, 3).astype("float32"))
    # After refusing, the pipeline still trains.
    assert pipe.train_step(rng.randn(8, 6).astype("float32"), rng.randn(8, 3).astype("float32")) > 0


def test_messages_go_over_mpi_under_mpi_and_over_zeromq_under_gloo(monkeypatch):
    # mpirun: Horovod on MPI, so activations and gradients go rank to rank over mpi4py; horovodrun
    # --gloo: no MPI world, so over ZeroMQ (the training tests above ran that way).
    gloo = "HOROVOD_GLOO_RENDEZVOUS_ADDR" in os.environ
    assert horovod.mpi_enabled() is not gloo
    assert DistributedPipeline(mlp(), [3, 2], chunks=2, loss_fn="mse").transport == ("zmq" if gloo else "mpi")
    monkeypatch.setenv("DUALFRAME_PIPELINE_TRANSPORT", "mpi")
    if gloo:
        with pytest.raises(StrategyError, match=r"=mpi needs mpi point-to-point on every rank \(2 of 2 lack it; "
                                                r"here: Horovod runs on Gloo"):
            DistributedPipeline(mlp(), [3, 2], chunks=2, loss_fn="mse")
    # transport= wins over the variable: asked for on every rank, taken (zmq: under gloo, mpi: under mpirun).
    assert DistributedPipeline(mlp(), [3, 2], chunks=2, loss_fn="mse",
                               transport="zmq" if gloo else "mpi").transport == ("zmq" if gloo else "mpi")
    with pytest.raises(StrategyError, match=r"transport must be one of auto, mpi, zmq, horovod, or None to read "
                                            r"DUALFRAME_PIPELINE_TRANSPORT \(transport: 'gloo'\)"):
        DistributedPipeline(mlp(), [3, 2], chunks=2, loss_fn="mse", transport="gloo")
    monkeypatch.setenv("DUALFRAME_PIPELINE_TRANSPORT", "zmq")
    pipe = DistributedPipeline(mlp(), [3, 2], chunks=2, schedule="1f1b", loss_fn="mse", transport="horovod")
    assert pipe.direct is None and pipe.transport == "horovod"
    # Horovod broadcasts under mpirun too: one step still equals one process.
    x, y = batches(STEPS, BATCH)[0]
    assert pipe.train_step(x, y) == pytest.approx(reference([(x, y)])[0][0], abs=1e-5)
