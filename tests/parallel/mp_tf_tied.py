"""Keras tied weights across 2 process stages: each stage calling a layer holds a copy, gradients summed each step.

The twin of mp_torch_tied.py. A functional model calling one Dense at its start and its end, cut at "mid",
and keras_hub's GPT2CausalLM cut at its head (the token embedding called in reverse): the loss of each of
2 SGD steps and every weight after them equal one process training the unsplit model (float64, 1e-9); the
stages' weights join into the model's list (each tied variable once) and ``set_weights`` loads every copy.
"""
# np: 2
# timeout: 400
import tempfile

import keras
import numpy as np
import pytest

import dualframe.tensorflow as hvd
from dualframe.tensorflow.pipeline.distributed import DistributedPipeline
# tests/parallel is on sys.path (pytest rootdir import)
from keras_pipeline_models import (assert_weights, float64_batches, one_process, shared_ends, tied_gpt2,
                                   token_batches, train_pipeline)

hvd.init()

CASES = {
    "shared_ends": (shared_ends, ["mid"], lambda: float64_batches(2, 4),
                    lambda: keras.losses.MeanSquaredError(dtype="float64"),
                    [("shared/kernel",), ("shared/bias",)]),
    "keras_hub_gpt2": (tied_gpt2, ["token_embedding"], lambda: token_batches(2, 4),
                       lambda: keras.losses.SparseCategoricalCrossentropy(from_logits=True, dtype="float64"),
                       [("token_embedding/embeddings",)]),
}


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("case", list(CASES))
def test_tied_layer_across_processes_trains_as_one_process(case, schedule):
    make, points, data, loss, names = CASES[case]
    expected, want = one_process(make(), data(), keras.optimizers.SGD(0.5), loss())
    pipe = DistributedPipeline(make(), split_points=points, chunks=2, schedule=schedule, loss_fn=loss())
    assert [(w.names, w.stages) for w in pipe.tied.plan.tied] == [(n, (0, 1)) for n in names]
    train_pipeline(pipe, keras.optimizers.SGD(0.5), data(), expected)
    merged = pipe.gather_weights()
    assert_weights(merged, want, atol=1e-9)
    losses = [pipe.train_step(*feed) for feed in [(x if pipe.is_first else None, y) for x, y in data()[:1]]]
    assert np.isfinite(losses).all()


def test_copies_start_equal_and_set_weights_loads_every_copy():
    model = shared_ends()
    if hvd.rank() == 1:  # a drifted copy: the broadcast at build makes it stage 0's again
        model.get_layer("shared").kernel.assign_add(np.ones((6, 6)))
    pipe = DistributedPipeline(model, split_points=["mid"], loss_fn="mse")
    reference = shared_ends()
    np.testing.assert_array_equal(model.get_layer("shared").kernel.numpy(), reference.get_layer("shared").kernel.numpy())
    fresh = [w * 2.0 for w in reference.get_weights()]
    pipe.set_weights(fresh)
    assert_weights([v.numpy() for v in model.get_layer("shared").weights], fresh[:2], "the copy after set_weights", atol=0)


def test_a_stage_checkpoint_restores_every_copy():
    model = shared_ends()
    pipe = DistributedPipeline(model, split_points=["mid"], loss_fn="mse")
    folder = hvd.broadcast_object(tempfile.mkdtemp() if hvd.rank() == 0 else None, 0, name="folder")
    hvd.save_stage_checkpoint(folder, pipe, step=0)
    saved = [v.numpy() for v in model.get_layer("shared").weights]
    if hvd.rank() == 1:  # the copy is not in stage 1's file (stage 0 holds the layer): loading makes it stage 0's
        model.get_layer("shared").kernel.assign_add(np.ones((6, 6)))
    assert hvd.load_stage_checkpoint(folder, pipe).step == 0
    assert_weights([v.numpy() for v in model.get_layer("shared").weights], saved, "the copy after loading", atol=0)
