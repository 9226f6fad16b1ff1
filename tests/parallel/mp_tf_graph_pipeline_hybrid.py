"""Keras hybrid of a graph on 4 processes: 2 replicas x 2 stages of a (tokens, mask) encoder, against one process on the global batch.

The twin of mp_torch_graph_pipeline_hybrid.py. Each replica's stage 0 sends its stage 1 the hidden states
and the bool attention mask in one exact byte message per micro-batch; gradients are averaged among the
replicas of each stage.
"""
# np: 4
# timeout: 400
import keras
import numpy as np
import pytest
import tensorflow as tf

import dualframe.tensorflow as hvd
from dualframe.pipeline.layout import pipeline_process_sets
from dualframe.tensorflow.distributed_pipeline import DistributedPipeline

STEPS, GLOBAL_BATCH, T, VOCAB = 3, 16, 6, 30
hvd.init(process_sets=pipeline_process_sets(4, 2))  # 2 stages: every edge is a neighbour pair


def make_encoder():
    """(tokens, padding mask) -> embedding -> 2 attention blocks reading one attention mask -> logits."""
    keras.utils.set_random_seed(5)
    tokens = keras.Input((T,), dtype="int64", name="tokens")
    mask = keras.Input((T,), dtype="bool", name="mask")
    attention = keras.layers.Reshape((1, T), name="attention_mask")(mask)
    h = keras.layers.Embedding(VOCAB, 8, name="embed")(tokens)
    for b in range(2):
        a = keras.layers.MultiHeadAttention(2, 4, name=f"b{b}_mha")(h, h, attention_mask=attention)
        h = keras.layers.LayerNormalization(name=f"b{b}_ln")(keras.layers.Add(name=f"b{b}_add")([h, a]))
    h = keras.layers.GlobalAveragePooling1D(name="pool")(h)
    return keras.Model({"tokens": tokens, "mask": mask}, keras.layers.Dense(2, name="head")(h))


def global_batches():
    rng = np.random.RandomState(4)
    out = []
    for _ in range(STEPS):
        lengths = rng.randint(2, T + 1, size=GLOBAL_BATCH)
        inputs = {"tokens": rng.randint(1, VOCAB, size=(GLOBAL_BATCH, T)).astype("int64"),
                  "mask": np.arange(T)[None, :] < lengths[:, None]}
        out.append((inputs, rng.randn(GLOBAL_BATCH, 2).astype("float32")))
    return out


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_hybrid_graph_equals_one_process_on_the_global_batch(schedule):
    data = global_batches()
    reference, ref_optimizer = make_encoder(), keras.optimizers.SGD(0.2)
    # inputs, mask, embedding, block 0 (3 layers) | block 1, pool, head
    pipe = DistributedPipeline(make_encoder(), balance=[7, 5], chunks=4, schedule=schedule, loss_fn="mse",
                               data_parallel=2)
    pipe.set_weights(reference.get_weights())
    edges = pipe.role.edges
    assert (edges.sources, edges.targets) == {0: ((), (1,)), 1: ((0,), ())}[pipe.stage_index]
    optimizer = pipe.distributed_optimizer(keras.optimizers.SGD(0.2))
    rows = GLOBAL_BATCH // 2
    for step, (x, y) in enumerate(data):
        with tf.GradientTape() as tape:
            expected = keras.losses.MeanSquaredError()(y, reference(x))
        grads = tape.gradient(expected, reference.trainable_variables)
        ref_optimizer.apply_gradients(zip(grads, reference.trainable_variables))
        shard = slice(pipe.replica * rows, (pipe.replica + 1) * rows)
        loss = pipe.train_step({k: v[shard] for k, v in x.items()}, y[shard])
        pipe.apply_gradients(optimizer)
        assert loss == pytest.approx(float(expected), abs=1e-5), f"step {step}"
    merged = pipe.gather_weights()  # every replica's pipeline holds the one-process weights
    assert len(merged) == len(reference.get_weights())
    for got, want in zip(merged, reference.get_weights()):
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
