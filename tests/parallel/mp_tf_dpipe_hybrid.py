"""Keras hybrid on 4 processes: 2 replicas x 2 stages, GPipe and 1F1B, against one process training the whole model on the global batch.

Also ZeRO-3 among each stage's replicas (``shard="parameters"``: a chain and a functional model, SGD with
momentum and Adam, each rank holding half its stage's values and optimizer state between steps; with
``backward_passes_per_step=2``, fp16 compression, float16 and mixed_float16 layers), and the
hybrid's stage checkpoints, plain and ZeRO-3: k steps, save (one writer per stage), a fresh perturbed pipeline
on every rank, load (broadcast among each stage's replicas), the remaining steps == the straight run;
the merged stages == one process.
"""
import os
# np: 4
# timeout: 400
import keras
import numpy as np
import pytest
import tensorflow as tf

import dualframe.tensorflow as hvd
import dualframe.tensorflow.keras as hvd_keras
from dualframe.errors import StrategyError
from dualframe.pipeline.layout import pipeline_process_sets
from dualframe.tensorflow.pipeline.distributed import DistributedPipeline
# tests/parallel is on sys.path (pytest rootdir import)
from keras_pipeline_models import (assert_weights, batches, embedding_batches, encoder_batches, make_embedding_model,
                                   make_encoder, mlp, one_process, replica_feed, train_pipeline)

STEPS, GLOBAL_BATCH, CHUNKS = 3, 16, 4  # each replica 8 rows: micro-batches of 2
# The process sets the pipeline needs, declared at start-up: neighbour pairs, pipelines, stage replicas.
hvd.init(process_sets=pipeline_process_sets(4, 2))


def make_model():
    """The shared MLP in this file's sizes: 5 features, 12 wide, tanh twice, 2 outputs."""
    return mlp(seed=3, features=5, width=12, outputs=2, second="tanh")


def global_batches(steps=STEPS, seed=5):
    return batches(steps, GLOBAL_BATCH, features=5, outputs=2, seed=seed)


def reference(data):
    """One process trains the whole model on the global batches: losses and final weights."""
    return one_process(make_model(), data, keras.optimizers.SGD(0.2, momentum=0.9))


def test_started_on_four_processes():
    assert hvd.size() == 4


@pytest.mark.parametrize("schedule, sharding, checkpoint", [("gpipe", None, "never"), ("1f1b", None, "never"),
                                                           ("1f1b", "optimizer", "never"), ("zb-h1", None, "always")])
def test_hybrid_equals_one_process_on_the_global_batch(schedule, sharding, checkpoint):
    """shard="optimizer": the stage's optimizer state is sharded among its 2 replicas (ZeRO-1 in the hybrid);
    checkpoint=: each stage recomputes its micro-batches' forward in their backward."""
    data = global_batches()
    expected_losses, expected_weights = reference(data)
    pipe = DistributedPipeline(make_model(), balance=[3, 2], chunks=CHUNKS, schedule=schedule, loss_fn="mse",
                               data_parallel=2, checkpoint=checkpoint)
    assert (pipe.replica, pipe.stage_index) == divmod(hvd.rank(), 2)
    assert pipe.stage_ranks == [pipe.stage_index, 2 + pipe.stage_index]
    optimizer = pipe.distributed_optimizer(keras.optimizers.SGD(0.2, momentum=0.9), shard=sharding)
    train_pipeline(pipe, optimizer, data, expected_losses, feed=replica_feed)  # each replica its half of the batch
    # Each replica's pipeline merges into the full model; both replicas hold the same weights.
    assert_weights(pipe.gather_weights(), expected_weights)
    if sharding:  # the stage's state was cut between its two replicas
        assert optimizer.sharded_for() == 2 and optimizer.reduction.process_set is pipe.stage_process_set
    replicas = hvd.allgather_object(pipe.get_weights(), name=f"hybrid.{schedule}.{sharding}.weights")
    assert_weights(replicas[pipe.stage_index], replicas[2 + pipe.stage_index], "replica 0 vs replica 1", atol=0)



def test_embedding_under_adam_with_replicas_equals_plain_keras():
    """Each replica's step IndexedSlices are allgathered and averaged among the stage's replicas: Adam on the
    embedding then trains as plain Keras on the global batch (its tape's IndexedSlices)."""
    data = embedding_batches(STEPS, GLOBAL_BATCH)
    losses, weights = one_process(make_embedding_model(), data, keras.optimizers.Adam(0.01))
    pipe = DistributedPipeline(make_embedding_model(), balance=[2, 2], chunks=CHUNKS, schedule="1f1b", loss_fn="mse",
                               data_parallel=2)
    train_pipeline(pipe, pipe.distributed_optimizer(keras.optimizers.Adam(0.01)), data, losses, feed=replica_feed)
    assert_weights(pipe.gather_weights(), weights)

ENCODER = {"outputs": 2, "token_dtype": "int64"}


def zero3_case(kind, optimizer):
    """(pipeline, one-process losses and weights, feed) for a chain (the MLP) or a graph (the encoder)."""
    if kind == "chain":
        data = global_batches()
        return make_model(), {"balance": [3, 2]}, one_process(make_model(), data, optimizer()), data
    data, reference = encoder_batches(STEPS, GLOBAL_BATCH, **ENCODER), make_encoder(**ENCODER)
    return make_encoder(**ENCODER), {"balance": [7, 5]}, dense_one_process(reference, data, optimizer()), data


def dense_one_process(model, data, optimizer):
    """``one_process`` with the embedding's gradient made dense, as a pipeline stage sums it: Keras's Adam on an
    IndexedSlices gradient leaves the moments of the rows it does not name undecayed (ZeRO makes gradients dense)."""
    losses, loss_fn = [], keras.losses.MeanSquaredError()
    for x, y in data:
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x))
        grads = [tf.convert_to_tensor(g) for g in tape.gradient(loss, model.trainable_variables)]
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        losses.append(float(loss))
    return losses, model.get_weights()


def check_held_half(optimizer):
    """Between steps: the variables empty, the slices and their state half the stage's (up to the padding)."""
    assert all(v.numpy().size == 0 for v in optimizer.stage_variables if v.shape.rank)
    held, full = optimizer.held_bytes(), optimizer.full_bytes()
    assert held == optimizer.parameter_bytes() + optimizer.state_bytes()
    slots = len(optimizer._zero.slot_names())  # momentum: 1, Adam: 2
    padding = len(optimizer._zero.layout.buckets) * 4 * (1 + slots)  # at most one element per slice and bucket
    assert full / 2 <= held <= full / 2 + padding, f"rank {hvd.rank()}: held {held} of the stage's {full} bytes"


def check_built_once(pipe, optimizer):
    """``build`` again, on the stage's variables or on the slices, keeps the slices, their values and the slots
    (before, it cut the emptied variables again); other variables are refused by name (no message: each rank alike)."""
    slices, values = optimizer._zero.slices, [s.numpy() for s in optimizer._zero.slices]
    inner = list(optimizer._zero.inner.variables)
    for variables in (pipe.trainable_variables, optimizer.parameter_slices()):
        optimizer.build(variables)
    assert len(optimizer._zero.slices) == len(slices) and all(a is b for a, b in zip(optimizer._zero.slices, slices))
    assert all(np.array_equal(s.numpy(), v) for s, v in zip(slices, values))
    assert len(optimizer._zero.inner.variables) == len(inner)
    with pytest.raises(StrategyError, match=r"cannot be built again on 1 others"):
        optimizer.build(make_model().trainable_variables[:1])


@pytest.mark.parametrize("kind, schedule, adam, checkpoint", [("chain", "gpipe", False, "never"),
                                                              ("chain", "1f1b", True, "never"),
                                                              ("chain", "zb-h1", False, "always"),
                                                              ("graph", "1f1b", True, "never")])
def test_zero3_among_stage_replicas_equals_one_process(kind, schedule, adam, checkpoint):
    """shard="parameters": each replica holds half its stage's values and state between steps, gathers them once
    per step; the losses and merged weights after 3 steps equal one process on the global batch."""
    def make_optimizer():
        return keras.optimizers.Adam(1e-3) if adam else keras.optimizers.SGD(0.2, momentum=0.9)

    model, cut, (losses, weights), data = zero3_case(kind, make_optimizer)
    pipe = DistributedPipeline(model, chunks=CHUNKS, schedule=schedule, loss_fn="mse", data_parallel=2,
                               checkpoint=checkpoint, **cut)
    optimizer = pipe.distributed_optimizer(make_optimizer(), shard="parameters")
    assert pipe.sharded is optimizer and optimizer.sharded_for() == 2
    check_built_once(pipe, optimizer)
    check_held_half(optimizer)
    train_pipeline(pipe, optimizer, data, losses, feed=replica_feed)
    check_held_half(optimizer)
    assert_weights(pipe.gather_weights(), weights)  # every replica's pipeline merges into the one-process model
    check_held_half(optimizer)
    if kind == "chain":  # inference gathers the stage and frees it again
        reference = make_model()
        reference.set_weights(weights)
        out = pipe(data[0][0])
        if pipe.is_last:
            np.testing.assert_allclose(out.numpy(), reference(data[0][0]).numpy(), atol=1e-5, rtol=0)
        check_held_half(optimizer)


def test_zero3_among_stage_replicas_refuses_what_is_not_built():
    """On every rank alike, before any message: arguments it does not take, a second optimizer, virtual stages
    (tied weights: mp_tf_graph_pipeline_hybrid.py)."""
    pipe = DistributedPipeline(make_model(), balance=[3, 2], chunks=CHUNKS, schedule="1f1b", loss_fn="mse",
                               data_parallel=2)
    sgd = keras.optimizers.SGD(0.1)
    with pytest.raises(StrategyError, match=r"keep_gathered= has no use in a pipeline stage"):
        pipe.distributed_optimizer(sgd, shard="parameters", keep_gathered=1)
    with pytest.raises(StrategyError, match=r"does not take groups yet"):
        pipe.distributed_optimizer(sgd, shard="parameters", groups=2)
    with pytest.raises(StrategyError, match=r"cannot take a LossScaleOptimizer: the pipeline's stages compute"):
        pipe.distributed_optimizer(keras.optimizers.LossScaleOptimizer(sgd), shard="parameters")
    with pytest.raises(StrategyError, match=r"shard= needs an optimizer that updates each element"):
        pipe.distributed_optimizer(keras.optimizers.Lamb(), shard="parameters")
    pipe.distributed_optimizer(sgd, shard="parameters")
    with pytest.raises(StrategyError, match=r"sharded by its shard='parameters' optimizer already"):
        pipe.distributed_optimizer(keras.optimizers.SGD(0.1))
    keras.mixed_precision.set_global_policy("mixed_float16")  # compile would scale the loss, as Keras's does
    try:
        half = DistributedPipeline(make_model(), balance=[3, 2], chunks=CHUNKS, schedule="1f1b", loss_fn="mse",
                                   data_parallel=2)
        zero3 = half.distributed_optimizer(keras.optimizers.SGD(0.1), shard="parameters")
        with pytest.raises(StrategyError, match=r"a shard='parameters' stage optimizer cannot do yet: use "
                                                r"mixed_bfloat16"):
            half.compile(zero3, loss="mse")
    finally:
        keras.mixed_precision.set_global_policy("float32")
    virtual = DistributedPipeline(make_model(), balance=[2, 1, 1, 1], chunks=CHUNKS, schedule="interleaved-1f1b",
                                  loss_fn="mse", data_parallel=2, virtual_stages=2)
    with pytest.raises(StrategyError, match=r"runs one stage per rank with schedule 'gpipe', '1f1b' or 'zb-h1' "
                                            r"\(schedule: 'interleaved-1f1b', virtual_stages: 2\)"):
        virtual.distributed_optimizer(sgd, shard="parameters")


def test_zero3_replicas_cut_their_slices_from_replica_0s_weights():
    """A replica whose weights differ when the optimizer is made (no common seed) still trains as one process
    from replica 0's: the stage's values are broadcast among its replicas before the slices are cut."""
    data = global_batches(seed=27)
    losses, weights = one_process(make_model(), data, keras.optimizers.SGD(0.2, momentum=0.9))
    pipe = DistributedPipeline(make_model(), balance=[3, 2], chunks=CHUNKS, schedule="1f1b", loss_fn="mse",
                               data_parallel=2)
    if pipe.replica:
        for variable in pipe.trainable_variables:
            variable.assign(variable + 0.5)
    optimizer = pipe.distributed_optimizer(keras.optimizers.SGD(0.2, momentum=0.9), shard="parameters")
    train_pipeline(pipe, optimizer, data, losses, feed=replica_feed)
    assert_weights(pipe.gather_weights(), weights)


def zero3_pipe(model=None, **kwargs):
    """A 1F1B hybrid of the MLP (or ``model``) and its ``shard="parameters"`` SGD with momentum (``kwargs`` its)."""
    pipe = DistributedPipeline(model or make_model(), balance=[3, 2], chunks=CHUNKS, schedule="1f1b", loss_fn="mse",
                               data_parallel=2)
    return pipe, pipe.distributed_optimizer(keras.optimizers.SGD(0.2, momentum=0.9), shard="parameters", **kwargs)


def test_zero3_backward_passes_per_step_equals_one_process_on_the_k_times_batch():
    """backward_passes_per_step=2, averaged: the 2 steps' gradients summed in full on each rank (the stage stays
    gathered between them, as torch's), reduced once, one update: one process on the 2 batches joined (1e-5)."""
    data = global_batches(4, seed=21)
    joined = [(np.concatenate([a[0], b[0]]), np.concatenate([a[1], b[1]])) for a, b in zip(data[::2], data[1::2])]
    losses, weights = one_process(make_model(), joined, keras.optimizers.SGD(0.2, momentum=0.9))
    pipe, optimizer = zero3_pipe(backward_passes_per_step=2, average_aggregated_gradients=True)
    got = []
    for step, (x, y) in enumerate(data):
        got.append(hybrid_step(pipe, optimizer, x, y))
        if step % 2 == 0:  # within the update: the values stay, no update yet; reading them keeps them
            assert all(v.numpy().size for v in optimizer.stage_variables) and int(optimizer.iterations) == step // 2
            pipe.get_weights()
            assert all(v.numpy().size for v in optimizer.stage_variables)
            with pytest.raises(StrategyError, match=r"1 of 2 steps into an update"):
                optimizer.state_arrays()
        else:
            check_held_half(optimizer)
    assert int(optimizer.iterations) == 2
    # Each update's loss: the mean of its two steps' (the same weights), as one process's on the joined batch.
    np.testing.assert_allclose([(a + b) / 2 for a, b in zip(got[::2], got[1::2])], losses, atol=1e-5)
    assert_weights(pipe.gather_weights(), weights)


# fp16 compression: each replica's summed gradients go through float16 before the average (Horovod's
# compress/decompress around the allreduce); SGD's weights stay within 3e-3 of one process (mp_tf_shard.py's bound).
def test_zero3_fp16_compression_within_fp16_tolerance():
    data = global_batches(seed=23)
    losses, weights = one_process(make_model(), data, keras.optimizers.SGD(0.2, momentum=0.9))
    pipe, optimizer = zero3_pipe(compression=hvd.Compression.fp16)
    assert optimizer.reduction.compression is hvd.Compression.fp16
    train_pipeline(pipe, optimizer, data, losses, feed=replica_feed, atol=3e-3)
    got = pipe.gather_weights()
    assert_weights(got, weights, "fp16 compression vs one process", 3e-3)
    worst = max(np.abs(a - b).max() for a, b in zip(got, weights))
    assert worst > 1e-5, f"rank {hvd.rank()}: {worst}: within float32's error, the gradients were not compressed"


def half_model(dtype):
    """``make_model``'s MLP with its first four layers in ``dtype`` ("float16": float16 variables; "mixed_float16":
    float32 variables, float16 compute); the last Dense float32 (the loss in float32)."""
    init = keras.initializers.GlorotUniform
    return keras.Sequential([
        keras.Input((5,)), keras.layers.Dense(12, kernel_initializer=init(3), dtype=dtype),
        keras.layers.Activation("tanh", dtype=dtype), keras.layers.Dense(12, kernel_initializer=init(4), dtype=dtype),
        keras.layers.Activation("tanh", dtype=dtype), keras.layers.Dense(2, kernel_initializer=init(5))])


@pytest.mark.parametrize("dtype", ["float16", "mixed_float16"])
def test_zero3_float16_layers_equal_one_process(dtype):
    """float16 variables step through float32 master slices, against one process training the same layers as
    mixed_float16 (float32 variables) from the same values; 2e-3 as mp_tf_zero3.py's float16 test (a float16
    weight is its master's cast, a float16 step at |w| < 2 is 9.8e-4). mixed_float16: against one process alike."""
    data = global_batches(seed=25)
    pipe, optimizer = zero3_pipe(half_model(dtype))
    assert str(optimizer.stage_variables[0].dtype) == ("float16" if dtype == "float16" and pipe.is_first else "float32")
    assert all(s.dtype == "float32" for s in optimizer._zero.slices)
    reference = half_model("mixed_float16")
    reference.set_weights([w.astype("float32") for w in half_model(dtype).get_weights()])
    losses, weights = one_process(reference, data, keras.optimizers.SGD(0.2, momentum=0.9))
    train_pipeline(pipe, optimizer, data, losses, feed=replica_feed, atol=2e-3)
    got = pipe.gather_weights()
    assert got[0].dtype == (np.float16 if dtype == "float16" else np.float32)
    assert_weights([w.astype("float32") for w in got], weights, f"{dtype} vs one process", 2e-3)


RESUME_STEPS, SAVE_AFTER = 4, 2


def hybrid_run(seed=0, shard=None):
    """A 1F1B hybrid pipeline + its distributed SGD with momentum; weights perturbed by ``seed`` (0: the model's own)."""
    pipe = DistributedPipeline(make_model(), balance=[3, 2], chunks=CHUNKS, schedule="1f1b", loss_fn="mse",
                               data_parallel=2)
    if seed:  # every rank its own wrong weights: only a load that reaches every replica puts them right
        rng = np.random.RandomState(seed + hvd.rank())
        for variable in pipe.trainable_variables:
            variable.assign_add(rng.randn(*variable.shape).astype("float32"))
    return pipe, pipe.distributed_optimizer(keras.optimizers.SGD(0.2, momentum=0.9), shard=shard)


def hybrid_step(pipe, optimizer, x, y):
    loss = pipe.train_step(*replica_feed(pipe, x, y))
    pipe.apply_gradients(optimizer)
    return loss


@pytest.mark.parametrize("shard", [None, "parameters"])
def test_hybrid_stage_checkpoint_resume_and_merge(tmp_path, shard):
    """shard="parameters": the stages' files hold the unsharded values and optimizer state (gathered first)."""
    folder = hvd.broadcast_object(str(tmp_path), 0, name=f"hybrid.ckpt.folder.{shard}")  # one folder for all ranks
    ckpt, data = os.path.join(folder, "ckpt"), global_batches(RESUME_STEPS, seed=11)
    pipe, optimizer = hybrid_run(shard=shard)
    straight_losses = [hybrid_step(pipe, optimizer, x, y) for x, y in data]
    straight = pipe.get_weights()

    pipe, optimizer = hybrid_run(shard=shard)
    for x, y in data[:SAVE_AFTER]:
        hybrid_step(pipe, optimizer, x, y)
    np.random.seed(100 + hvd.rank())  # each rank its own numpy stream, saved with its stage
    written = hvd.save_stage_checkpoint(ckpt, pipe, optimizer, step=SAVE_AFTER - 1,
                                        data_position={"next_step": SAVE_AFTER})
    assert (written is not None) == (pipe.replica == 0), f"rank {hvd.rank()} wrote {written}"
    saved, draw = pipe.get_weights(), np.random.rand(3)
    assert sorted(os.listdir(ckpt)) == ["stage-0", "stage-1"]

    pipe, optimizer = hybrid_run(77, shard)  # fresh, perturbed, optimizer not built, another numpy stream
    np.random.seed(999)
    state = hvd.load_stage_checkpoint(ckpt, pipe, optimizer)
    assert state.step == SAVE_AFTER - 1 and state.data_position == {"next_step": SAVE_AFTER}, state
    assert_weights(pipe.get_weights(), saved, "loaded vs saved", 0)  # every replica holds what its writer saved
    np.testing.assert_array_equal(np.random.rand(3), draw, err_msg=f"rank {hvd.rank()}: RNG not restored")
    for step in range(SAVE_AFTER, RESUME_STEPS):
        loss = hybrid_step(pipe, optimizer, *data[step])
        assert loss == pytest.approx(straight_losses[step], abs=1e-5), f"step {step} after resuming"
    assert_weights(pipe.get_weights(), straight, "resumed vs straight", 1e-5)
    check_merged(ckpt, folder, pipe, data, straight_losses, shard)


def check_merged(ckpt, folder, pipe, data, straight_losses, shard):
    """Save the end, merge the stages; the full model == one process; every stage loads rank 0's merged file."""
    hvd.save_stage_checkpoint(ckpt, pipe, step=RESUME_STEPS - 1, data_position={"next_step": RESUME_STEPS})
    losses, weights = reference(data)
    assert losses == pytest.approx(straight_losses, abs=1e-5), "hybrid vs one process"
    mine = os.path.join(folder, f"full-{hvd.rank()}.npz")  # every rank merges its copy (no communication)
    hvd.merge_stage_checkpoints(ckpt, mine)
    full = make_model()
    hvd_keras.load_checkpoint(mine, full, restore_rng=False)  # a collective: rank 0 reads its copy
    assert_weights(full.get_weights(), weights, "merged vs one process", 1e-5)
    again, _ = hybrid_run(55, shard)  # rank 0 reads its merged file, each stage takes its part
    assert hvd.load_stage_checkpoint(os.path.join(folder, "full-0.npz"), again).step == RESUME_STEPS - 1
    assert_weights(again.get_weights(), pipe.get_weights(), "taken from the merged file", 0)
