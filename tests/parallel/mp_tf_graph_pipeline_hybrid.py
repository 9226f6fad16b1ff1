"""Keras hybrid of a graph on 4 processes: 2 replicas x 2 stages of a (tokens, mask) encoder, against one process on the global batch.

The twin of mp_torch_graph_pipeline_hybrid.py. Each replica's stage 0 sends its stage 1 the hidden states
and the bool attention mask in one exact byte message per micro-batch; gradients are averaged among the
replicas of each stage. A layer called by both stages (tied) has a copy on each: its gradient is summed
over the holders, then averaged over the replicas.
"""
# np: 4
# timeout: 400
import keras
import pytest

import dualframe.tensorflow as hvd
from dualframe.errors import StrategyError
from dualframe.pipeline.layout import pipeline_process_sets
from dualframe.tensorflow.pipeline.distributed import DistributedPipeline
# tests/parallel is on sys.path (pytest rootdir import)
from keras_pipeline_models import (assert_weights, encoder_batches, float64_batches, make_encoder, one_process,
                                   replica_feed, shared_ends, train_pipeline)

STEPS, GLOBAL_BATCH = 3, 16
ENCODER = {"outputs": 2, "token_dtype": "int64"}  # mp_tf_dpipe_graph.py's encoder: 3 outputs, int32 tokens
hvd.init(process_sets=pipeline_process_sets(4, 2))  # 2 stages: every edge is a neighbour pair


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_hybrid_graph_equals_one_process_on_the_global_batch(schedule):
    data = encoder_batches(STEPS, GLOBAL_BATCH, **ENCODER)
    reference = make_encoder(**ENCODER)
    # inputs, mask, embedding, block 0 (3 layers) | block 1, pool, head
    pipe = DistributedPipeline(make_encoder(**ENCODER), balance=[7, 5], chunks=4, schedule=schedule, loss_fn="mse",
                               data_parallel=2)
    pipe.set_weights(reference.get_weights())  # before the reference trains: both start from its weights
    edges = pipe.role.edges
    assert (edges.sources, edges.targets) == {0: ((), (1,)), 1: ((0,), ())}[pipe.stage_index]
    expected_losses, expected_weights = one_process(reference, data, keras.optimizers.SGD(0.2))
    optimizer = pipe.distributed_optimizer(keras.optimizers.SGD(0.2))
    train_pipeline(pipe, optimizer, data, expected_losses, feed=replica_feed)  # each replica its half of the batch
    assert_weights(pipe.gather_weights(), expected_weights)  # every replica's pipeline holds the one-process weights


def test_hybrid_with_a_layer_both_stages_call_equals_one_process_on_the_global_batch():
    data = float64_batches(STEPS, GLOBAL_BATCH)
    loss = keras.losses.MeanSquaredError(dtype="float64")
    expected_losses, expected_weights = one_process(shared_ends(), data, keras.optimizers.SGD(0.5), loss)
    pipe = DistributedPipeline(shared_ends(), split_points=["mid"], chunks=2, loss_fn=loss, data_parallel=2)
    assert [w.stages for w in pipe.tied.plan.tied] == [(0, 1), (0, 1)]
    with pytest.raises(StrategyError, match=r"shard='parameters' cannot keep the copies of this model's tied"):
        pipe.distributed_optimizer(keras.optimizers.SGD(0.5), shard="parameters")  # on every rank, before any message
    optimizer = pipe.distributed_optimizer(keras.optimizers.SGD(0.5))
    train_pipeline(pipe, optimizer, data, expected_losses, feed=replica_feed)
    assert_weights(pipe.gather_weights(), expected_weights, atol=1e-9)
