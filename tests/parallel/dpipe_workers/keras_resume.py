"""Exact resume of a Keras process pipeline (2 stages, 1F1B): 10 steps straight == 5 steps, job killed, 5 resumed.

The Keras twin of torch_resume.py. ``--phase crash``: train 10 steps straight (each stage's weights
in ``straight-{j}.npz``, the losses in ``losses.json``), start again from the same seeds, save the
stages every step and SIGKILL stage 1's rank after the checkpoint of step 5. ``--phase resume``:
load every stage's part, train steps 6-10, compare losses and weights with the straight run, merge
the stages into the full model's checkpoint, load it into the plain model (and into a fresh
pipeline) and compare with the straight run and one process. Dropout's seed generator (a layer
variable), data drawn from numpy's global stream and SGD momentum make every part of the state matter.
Started by tests/parallel/test_dpipe_resume.py; not a pytest module.
"""
import os

import keras
import numpy as np
import tensorflow as tf

import dualframe.tensorflow as hvd
from dualframe.tensorflow.keras import load_checkpoint
# PYTHONPATH is the repository root (every launch sets it): tests.parallel imports from this folder too.
from tests.parallel.resume_phases import resume_stages, run_phase, save_stages_until_killed, save_straight_losses

STEPS, KILL_AFTER, BATCH, CHUNKS, TOL = 10, 5, 8, 4, 1e-6


def build():
    """The same weights and Dropout seed everywhere."""
    init = keras.initializers.GlorotUniform
    return keras.Sequential([
        keras.Input((6,)), keras.layers.Dense(16, kernel_initializer=init(1)), keras.layers.Dropout(0.3, seed=5),
        keras.layers.Activation("tanh"), keras.layers.Dense(8, kernel_initializer=init(2)),
        keras.layers.Activation("relu"), keras.layers.Dense(1, kernel_initializer=init(3)),
    ])


def batch():
    """The next batch from numpy's global stream (the same on every rank)."""
    x = np.random.randn(BATCH, 6).astype("float32")
    return x, (x.sum(1, keepdims=True) + 0.1 * np.random.randn(BATCH, 1)).astype("float32")


def fresh():
    pipe = hvd.DistributedPipeline(build(), [3, 3], chunks=CHUNKS, schedule="1f1b", loss_fn="mse")
    np.random.seed(1234)
    return pipe, keras.optimizers.SGD(0.05, momentum=0.9)


def step_once(pipe, optimizer):
    loss = pipe.train_step(*batch())
    pipe.apply_gradients(optimizer)
    return loss


def reference():
    """One process, the plain model, micro-batch by micro-batch (Dropout called in the same order): losses, weights."""
    model, optimizer, losses = build(), keras.optimizers.SGD(0.05, momentum=0.9), []
    np.random.seed(1234)
    for _ in range(STEPS):
        x, y = batch()
        with tf.GradientTape() as tape:
            total = tf.add_n([tf.reduce_mean(keras.losses.mean_squared_error(yi, model(xi, training=True))) * 0.25
                              for xi, yi in zip(np.split(x, CHUNKS), np.split(y, CHUNKS))])
        optimizer.apply_gradients(zip(tape.gradient(total, model.trainable_variables), model.trainable_variables))
        losses.append(float(total))
    return losses, [np.asarray(v.numpy()) for v in model.variables]


def stage_values(pipe):
    return [np.asarray(v.numpy()) for layer in pipe.layers for v in layer.variables]


def assert_close(got, expected, what, tol=TOL):
    assert len(got) == len(expected), f"{what}: {len(got)} variables, expected {len(expected)}"
    for i, (a, b) in enumerate(zip(got, expected)):
        error = float(np.max(np.abs(a.astype("float64") - b.astype("float64")))) if a.size else 0.0
        assert error <= tol, f"{what}: variable {i} differs by {error} (tolerance {tol})"


def crash(args):
    pipe, optimizer = fresh()
    losses = [step_once(pipe, optimizer) for _ in range(STEPS)]
    np.savez(os.path.join(args.dir, f"straight-{pipe.stage_index}.npz"), *stage_values(pipe))
    save_straight_losses(args.dir, losses, writer=hvd.rank() == 0)
    pipe, optimizer = fresh()
    save_stages_until_killed(hvd, pipe, optimizer, lambda step: step_once(pipe, optimizer), losses, args.dir,
                             KILL_AFTER, TOL)


def straight_values(folder, j):
    with np.load(os.path.join(folder, f"straight-{j}.npz"), allow_pickle=False) as arrays:
        return [arrays[f"arr_{i}"] for i in range(len(arrays.files))]


def resume(args):
    ckpt, merged = os.path.join(args.dir, "ckpt"), os.path.join(args.dir, "full.npz")
    pipe, optimizer = fresh()
    np.random.seed(999)  # another stream: the checkpoint must restore the saved one
    straight_losses = resume_stages(hvd, pipe, optimizer, lambda step: step_once(pipe, optimizer), args.dir,
                                    KILL_AFTER, STEPS, TOL)
    assert_close(stage_values(pipe), straight_values(args.dir, pipe.stage_index), f"stage {pipe.stage_index}")
    hvd.save_stage_checkpoint(ckpt, pipe, optimizer, step=STEPS - 1, data_position={"next_step": STEPS}, keep=2)
    if hvd.rank() == 0:
        hvd.merge_stage_checkpoints(ckpt, merged)
    hvd.broadcast(tf.zeros([1]), 0, name="merged")  # full.npz is complete before anyone reads it
    full = build()
    assert load_checkpoint(merged, full, restore_rng=False).step == STEPS - 1
    straight = straight_values(args.dir, 0) + straight_values(args.dir, 1)
    assert_close([np.asarray(v.numpy()) for v in full.variables], straight, "merged checkpoint vs straight run")
    again, _ = fresh()
    assert hvd.load_stage_checkpoint(merged, again).step == STEPS - 1
    assert_close(stage_values(again), stage_values(pipe), f"stage {again.stage_index} taken from the merged file", 0.0)
    losses, weights = reference()
    assert_close([np.asarray(v.numpy()) for v in full.variables], weights, "merged vs one-process reference", 1e-5)
    assert max(abs(a - b) for a, b in zip(losses, straight_losses)) <= 1e-5, (losses, straight_losses)
    if hvd.rank() == 0:
        print("dualframe-test: resumed run equals the straight run (losses, weights, merged full model, "
              "one-process reference)", flush=True)
    hvd.broadcast(tf.zeros([1]), 0, name="done")


if __name__ == "__main__":
    run_phase(hvd.init, crash, resume)
