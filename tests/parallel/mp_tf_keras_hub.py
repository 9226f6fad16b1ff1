"""Keras models nobody here wrote, split across 2 processes: keras_hub GPT-2 and BERT backbones, MobileNetV2, implicit masks.
# timeout: 480

Float64 (``keras.config.set_floatx``): each step's loss and the merged weights after the steps equal one
process training the unsplit model to 1e-9. The backbones take a dict batch (token ids, a padding
mask, BERT's segment ids) and are cut inside the transformer stack (``balance=`` and ``stages=`` count
the transformer layers); the padding mask crosses as a bool tensor beside the hidden states. With
Dropout on and one micro-batch, every rank draws the masks the one process draws (each rank built the
same seeded model, so its seed generators start in the same state). Models that hand Keras's implicit masks
from layer to layer (``Embedding(mask_zero=True)``) are cut between the masking layer and the layers that
read the mask: the mask crosses beside its tensor.
"""
import keras
import numpy as np
import pytest
import tensorflow as tf

import dualframe.tensorflow as hvd
from dualframe.errors import StrategyError
from dualframe.tensorflow.pipeline.distributed import DistributedPipeline
# tests/parallel is on sys.path (pytest rootdir import)
from keras_hub_models import HIDDEN, LENGTH, bert, gpt2, tokens
from keras_mask_models import MODELS, padded_batches, sequential
from keras_pipeline_models import assert_weights, one_process, train_pipeline

pytest.importorskip("keras_hub")
keras.config.set_floatx("float64")
keras.config.set_dtype_policy("float64")
hvd.init()
STEPS, ROWS, ATOL = 2, 6, 1e-9


def token_batches(model, outputs):
    rng = np.random.RandomState(3)
    return [(tokens(model, ROWS, seed=step), rng.randn(ROWS, *outputs)) for step in range(STEPS)]


def bert_loss(y, outputs):
    """Per row: the pooled output against ``y`` plus the sequence output's mean square (both outputs train)."""
    sequence = tf.reduce_mean(tf.square(outputs["sequence_output"]), axis=[1, 2])
    return tf.reduce_mean(tf.square(outputs["pooled_output"] - y), axis=1) + sequence


@pytest.mark.parametrize("schedule, chunks, cut", [("gpipe", 3, dict(balance=[2, 2])), ("1f1b", 2, dict(stages=2)),
                                                   ("zb-h1", 3, dict(split_points=["transformer_layer_1"]))])
def test_gpt2_cut_inside_the_stack_trains_as_one_process(schedule, chunks, cut):
    data = token_batches(gpt2(), (LENGTH, HIDDEN))
    want_losses, want_weights = one_process(gpt2(), data, keras.optimizers.SGD(0.1))
    pipe = DistributedPipeline(gpt2(), chunks=chunks, schedule=schedule, loss_fn="mse", **cut)
    assert pipe.split.split_points == (("transformer_layer_1",) if "split_points" in cut else ("transformer_layer_2",))
    train_pipeline(pipe, keras.optimizers.SGD(0.1), data, want_losses, atol=ATOL)
    assert_weights(pipe.gather_weights(), want_weights, atol=ATOL)
    out = pipe(data[0][0])  # inference takes the dict batch too
    if pipe.is_last:
        np.testing.assert_allclose(out.numpy(), gpt2_with(want_weights)(data[0][0]).numpy(), atol=ATOL, rtol=0)


def gpt2_with(weights):
    model = gpt2()
    model.set_weights(weights)
    return model


def test_bert_with_two_outputs_trains_as_one_process():
    data = token_batches(bert(), (HIDDEN,))
    want_losses, want_weights = one_process(bert(), data, keras.optimizers.SGD(0.1), loss_fn=bert_loss_mean)
    pipe = DistributedPipeline(bert(), balance=[1, 2], chunks=2, schedule="1f1b", loss_fn=bert_loss)
    train_pipeline(pipe, keras.optimizers.SGD(0.1), data, want_losses, atol=ATOL)
    assert_weights(pipe.gather_weights(), want_weights, atol=ATOL)


def bert_loss_mean(y, outputs):
    return tf.reduce_mean(bert_loss(y, outputs))


def test_dropout_on_draws_the_one_process_masks():
    data = token_batches(gpt2(), (LENGTH, HIDDEN))
    make = lambda: gpt2(layers=2, dropout=0.2)  # noqa: E731
    want_losses, want_weights = one_process(make(), data, keras.optimizers.SGD(0.1), training=True)
    pipe = DistributedPipeline(make(), balance=[1, 1], chunks=1, loss_fn="mse")
    train_pipeline(pipe, keras.optimizers.SGD(0.1), data, want_losses, atol=ATOL)
    assert_weights(pipe.gather_weights(), want_weights, atol=ATOL)


def one_process_in_turn(model, data, optimizer, chunks):
    """One process feeds each batch's micro-batches to the whole model in turn (each Dropout draws the next mask)."""
    losses = []
    for x, y in data:
        rows = len(y) // chunks
        with tf.GradientTape() as tape:
            loss = sum(tf.reduce_mean(keras.losses.mean_squared_error(
                y[i * rows:(i + 1) * rows], model({k: v[i * rows:(i + 1) * rows] for k, v in x.items()}, training=True)))
                for i in range(chunks)) / chunks
        optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
        losses.append(float(loss))
    return losses, model.get_weights()


def test_dropout_on_with_micro_batches_draws_the_masks_of_one_process_feeding_them_in_turn():
    data = token_batches(gpt2(), (LENGTH, HIDDEN))
    make = lambda: gpt2(layers=2, dropout=0.2)  # noqa: E731
    want_losses, want_weights = one_process_in_turn(make(), data, keras.optimizers.SGD(0.1), chunks=3)
    pipe = DistributedPipeline(make(), balance=[1, 1], chunks=3, schedule="1f1b", loss_fn="mse")
    train_pipeline(pipe, keras.optimizers.SGD(0.1), data, want_losses, atol=ATOL)
    assert_weights(pipe.gather_weights(), want_weights, atol=ATOL)


def test_mobilenet_v2_split_by_memory_trains_as_one_process():
    def make():
        keras.utils.set_random_seed(8)
        return keras.applications.MobileNetV2(input_shape=(32, 32, 3), alpha=0.35, weights=None, classes=5)

    rng = np.random.RandomState(9)
    data = [(rng.randn(4, 32, 32, 3), rng.randn(4, 5)) for _ in range(STEPS)]
    # one micro-batch: BatchNormalization normalises over the batch, as in the one process
    want_losses, want_weights = one_process(make(), data, keras.optimizers.SGD(0.01), training=True)
    pipe = DistributedPipeline(make(), stages=2, chunks=1, loss_fn="mse")
    train_pipeline(pipe, keras.optimizers.SGD(0.01), data, want_losses, atol=ATOL)
    assert_weights(pipe.gather_weights(), want_weights, atol=ATOL)


# The attention model's output keeps its mask, and a Keras loss averages over the unmasked tokens of what
# it is given: over each micro-batch's tokens in a process pipeline, so that one runs one micro-batch.
@pytest.mark.parametrize("name, schedule, chunks, cut", [("recurrent", "gpipe", 3, "attention"),
                                                         ("recurrent", "zb-h1", 3, "lstm"),
                                                         ("attention", "1f1b", 1, "attention")])
def test_implicit_masks_cross_processes(name, schedule, chunks, cut):
    make, outputs = MODELS[name]
    data = padded_batches(STEPS, ROWS, outputs)
    want_losses, want_weights = one_process(make(), data, keras.optimizers.SGD(0.1))
    pipe = DistributedPipeline(make(), split_points=[cut], chunks=chunks, schedule=schedule,
                               loss_fn=keras.losses.MeanSquaredError())
    train_pipeline(pipe, keras.optimizers.SGD(0.1), data, want_losses, atol=ATOL)
    assert_weights(pipe.gather_weights(), want_weights, atol=ATOL)


@pytest.mark.parametrize("built, why", [(True, "hands a Keras mask to the next stage"),
                                        (False, "makes a Keras mask that may still be on the tensor there")])
def test_a_chain_refuses_a_cut_where_a_mask_may_cross(built, why):
    """A Sequential on a keras.Input says where its mask is; a plain list only where one begins."""
    with pytest.raises(StrategyError, match=f"layer 'embed' {why}"):
        DistributedPipeline(sequential(built), balance=[1, 3], loss_fn="mse")
