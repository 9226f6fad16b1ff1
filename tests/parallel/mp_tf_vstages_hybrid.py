"""Keras virtual stages with replicas on 4 processes: 2 replicas x 2 ranks x 2 stages per rank, against one process.

Each rank holds two stages of its replica's pipeline; the ranks at the same position of the two replicas
hold the same stages and average their gradients (the position's process set), so the weights equal one
process training the whole model on the global batch. A stage checkpoint holds one part per position
(its two stages), written by replica 0 and loaded into every replica.
"""
# np: 4
# timeout: 400
import os

import keras
import numpy as np
import pytest

import dualframe.tensorflow as hvd
import dualframe.tensorflow.keras as hvd_keras
from dualframe.tensorflow.pipeline.distributed import DistributedPipeline
# tests/parallel is on sys.path (pytest rootdir import)
from keras_pipeline_models import assert_weights, one_process, replica_feed, train_pipeline
from mp_tf_dpipe_hybrid import global_batches  # 16 rows of 5 features; its import starts Horovod with the sets

STEPS, CHUNKS = 3, 4  # each replica 8 of the 16 rows: micro-batches of 2
BALANCE = [2, 2, 2, 1]  # four stages of the seven layers: two per rank
HELD = {"interleaved-1f1b": [[0, 2], [1, 3]], "zb-v": [[0, 3], [1, 2]]}  # by position in the pipeline


def make_model(seed=4):
    """Dense -> tanh -> Dense -> tanh -> Dense -> tanh -> Dense (7 layers, 5 features, 2 outputs)."""
    init = keras.initializers.GlorotUniform
    layers = [keras.Input((5,))]
    for k in range(3):
        layers += [keras.layers.Dense(12, kernel_initializer=init(seed + k),
                                      bias_initializer=keras.initializers.RandomNormal(seed=seed + k)),
                   keras.layers.Activation("tanh")]
    return keras.Sequential(layers + [keras.layers.Dense(2, kernel_initializer=init(seed + 9))])


def reference(data):
    """One process trains the whole model on the global batches: losses and final weights."""
    return one_process(make_model(), data, keras.optimizers.SGD(0.2, momentum=0.9))


@pytest.mark.parametrize("schedule, shard, checkpoint", [("interleaved-1f1b", None, "never"),
                                                        ("zb-v", None, "always"), ("zb-v", "gradients", "never")])
def test_virtual_stages_with_replicas_equal_one_process_on_the_global_batch(schedule, shard, checkpoint):
    data = global_batches(STEPS)
    expected_losses, expected_weights = reference(data)
    pipe = DistributedPipeline(make_model(), balance=BALANCE, chunks=CHUNKS, schedule=schedule, loss_fn="mse",
                               data_parallel=2, virtual_stages=2, checkpoint=checkpoint)
    assert (pipe.replica, pipe.stage_index) == divmod(hvd.rank(), 2)
    assert pipe.held_stages == HELD[schedule][pipe.stage_index]
    assert pipe.stage_ranks == [pipe.stage_index, 2 + pipe.stage_index]
    optimizer = pipe.distributed_optimizer(keras.optimizers.SGD(0.2, momentum=0.9), shard=shard)
    train_pipeline(pipe, optimizer, data, expected_losses, feed=replica_feed)  # each replica its half of the batch
    assert_weights(pipe.gather_weights(), expected_weights)  # each replica's pipeline merges into the model
    if shard:  # the position's state was cut between its two replicas
        assert optimizer.sharded_for() == 2 and optimizer.reduction.process_set is pipe.stage_process_set
    replicas = hvd.allgather_object(pipe.get_weights(), name=f"vstages.hybrid.{schedule}.{shard}.weights")
    assert_weights(replicas[pipe.stage_index], replicas[2 + pipe.stage_index], "replica 0 vs replica 1", atol=0)


def virtual_hybrid(seed=0):
    """A zb-v pipeline of 2 x 2 stages in 2 replicas + its averaged SGD; weights perturbed by ``seed`` (0: none)."""
    pipe = DistributedPipeline(make_model(), balance=BALANCE, chunks=CHUNKS, schedule="zb-v", loss_fn="mse",
                               data_parallel=2, virtual_stages=2)
    if seed:  # every rank its own wrong weights: only a load that reaches every replica puts them right
        rng = np.random.RandomState(seed + hvd.rank())
        for variable in pipe.trainable_variables:
            variable.assign_add(rng.randn(*variable.shape).astype("float32"))
    return pipe, pipe.distributed_optimizer(keras.optimizers.SGD(0.2, momentum=0.9))


def test_stage_checkpoint_of_virtual_stages_with_replicas_resumes_and_merges(tmp_path):
    folder = hvd.broadcast_object(str(tmp_path), 0, name="vstages.hybrid.ckpt.folder")  # one folder for all ranks
    ckpt, data = os.path.join(folder, "ckpt"), global_batches(STEPS, seed=11)
    expected_losses, expected_weights = reference(data)
    pipe, optimizer = virtual_hybrid()
    train_pipeline(pipe, optimizer, data[:2], expected_losses, feed=replica_feed)
    written = hvd.save_stage_checkpoint(ckpt, pipe, optimizer, step=1, data_position={"next_step": 2})
    assert (written is not None) == (pipe.replica == 0) and sorted(os.listdir(ckpt)) == ["stage-0", "stage-1"]
    saved = pipe.get_weights()
    pipe, optimizer = virtual_hybrid(77)  # fresh, perturbed, optimizer not built (no momentum yet)
    state = hvd.load_stage_checkpoint(ckpt, pipe, optimizer)
    assert state.step == 1 and state.data_position == {"next_step": 2}
    assert_weights(pipe.get_weights(), saved, "loaded vs saved", atol=0)  # every replica holds what replica 0 saved
    train_pipeline(pipe, optimizer, data[2:], expected_losses[2:], feed=replica_feed)  # the momentum came back too
    hvd.save_stage_checkpoint(ckpt, pipe, step=2)
    mine = os.path.join(folder, f"full-{hvd.rank()}.npz")  # every rank merges its copy (no communication)
    hvd.merge_stage_checkpoints(ckpt, mine)
    full = make_model(seed=99)
    hvd_keras.load_checkpoint(mine, full, restore_rng=False)  # a collective: rank 0 reads its copy
    assert_weights(full.get_weights(), expected_weights, "merged vs one process", atol=1e-5)
