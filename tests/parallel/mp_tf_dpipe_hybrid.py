"""Keras hybrid on 4 processes: 2 replicas x 2 stages, GPipe and 1F1B, against one process training the whole model on the global batch.

Also the hybrid's stage checkpoints: k steps, save (one writer per stage), a fresh perturbed pipeline
on every rank, load (broadcast among each stage's replicas), the remaining steps == the straight run;
the merged stages == one process.
"""
import os
# np: 4
# timeout: 400
import keras
import numpy as np
import pytest

import dualframe.tensorflow as hvd
import dualframe.tensorflow.keras as hvd_keras
from dualframe.pipeline.layout import pipeline_process_sets
from dualframe.tensorflow.pipeline.distributed import DistributedPipeline
# tests/parallel is on sys.path (pytest rootdir import)
from keras_pipeline_models import assert_weights, batches, mlp, one_process, replica_feed, train_pipeline

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


RESUME_STEPS, SAVE_AFTER = 4, 2


def hybrid_run(seed=0):
    """A 1F1B hybrid pipeline + its distributed SGD with momentum; weights perturbed by ``seed`` (0: the model's own)."""
    pipe = DistributedPipeline(make_model(), balance=[3, 2], chunks=CHUNKS, schedule="1f1b", loss_fn="mse",
                               data_parallel=2)
    if seed:  # every rank its own wrong weights: only a load that reaches every replica puts them right
        rng = np.random.RandomState(seed + hvd.rank())
        for variable in pipe.trainable_variables:
            variable.assign_add(rng.randn(*variable.shape).astype("float32"))
    return pipe, pipe.distributed_optimizer(keras.optimizers.SGD(0.2, momentum=0.9))


def hybrid_step(pipe, optimizer, x, y):
    loss = pipe.train_step(*replica_feed(pipe, x, y))
    pipe.apply_gradients(optimizer)
    return loss


def test_hybrid_stage_checkpoint_resume_and_merge(tmp_path):
    folder = hvd.broadcast_object(str(tmp_path), 0, name="hybrid.ckpt.folder")  # one folder for all ranks
    ckpt, data = os.path.join(folder, "ckpt"), global_batches(RESUME_STEPS, seed=11)
    pipe, optimizer = hybrid_run()
    straight_losses = [hybrid_step(pipe, optimizer, x, y) for x, y in data]
    straight = pipe.get_weights()

    pipe, optimizer = hybrid_run()
    for x, y in data[:SAVE_AFTER]:
        hybrid_step(pipe, optimizer, x, y)
    np.random.seed(100 + hvd.rank())  # each rank its own numpy stream, saved with its stage
    written = hvd.save_stage_checkpoint(ckpt, pipe, optimizer, step=SAVE_AFTER - 1,
                                        data_position={"next_step": SAVE_AFTER})
    assert (written is not None) == (pipe.replica == 0), f"rank {hvd.rank()} wrote {written}"
    saved, draw = pipe.get_weights(), np.random.rand(3)
    assert sorted(os.listdir(ckpt)) == ["stage-0", "stage-1"]

    pipe, optimizer = hybrid_run(77)  # fresh, perturbed, optimizer not built, another numpy stream
    np.random.seed(999)
    state = hvd.load_stage_checkpoint(ckpt, pipe, optimizer)
    assert state.step == SAVE_AFTER - 1 and state.data_position == {"next_step": SAVE_AFTER}, state
    assert_weights(pipe.get_weights(), saved, "loaded vs saved", 0)  # every replica holds what its writer saved
    np.testing.assert_array_equal(np.random.rand(3), draw, err_msg=f"rank {hvd.rank()}: RNG not restored")
    for step in range(SAVE_AFTER, RESUME_STEPS):
        loss = hybrid_step(pipe, optimizer, *data[step])
        assert loss == pytest.approx(straight_losses[step], abs=1e-5), f"step {step} after resuming"
    assert_weights(pipe.get_weights(), straight, "resumed vs straight", 1e-5)
    check_merged(ckpt, folder, pipe, data, straight_losses)


def check_merged(ckpt, folder, pipe, data, straight_losses):
    """Save the end, merge the stages; the full model == one process; every stage loads rank 0's merged file."""
    hvd.save_stage_checkpoint(ckpt, pipe, step=RESUME_STEPS - 1, data_position={"next_step": RESUME_STEPS})
    losses, weights = reference(data)
    assert losses == pytest.approx(straight_losses, abs=1e-5), "hybrid vs one process"
    mine = os.path.join(folder, f"full-{hvd.rank()}.npz")  # every rank merges its copy (no communication)
    hvd.merge_stage_checkpoints(ckpt, mine)
    full = make_model()
    hvd_keras.load_checkpoint(mine, full, restore_rng=False)  # a collective: rank 0 reads its copy
    assert_weights(full.get_weights(), weights, "merged vs one process", 1e-5)
    again, _ = hybrid_run(55)  # rank 0 reads its merged file, each stage takes its part
    assert hvd.load_stage_checkpoint(os.path.join(folder, "full-0.npz"), again).step == RESUME_STEPS - 1
    assert_weights(again.get_weights(), pipe.get_weights(), "taken from the merged file", 0)
