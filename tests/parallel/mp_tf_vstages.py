"""Keras DistributedPipeline with virtual stages on 2 processes (2 x 2 stages), interleaved 1F1B and ZB-V, against one process:
a list of layers and a functional model (its graph split).
# timeout: 400
"""
import os

import keras
import numpy as np
import pytest

import dualframe.tensorflow as hvd
import dualframe.tensorflow.keras as hvd_keras
from dualframe.errors import BalanceError, ChunksError, ScheduleError
from dualframe.tensorflow.pipeline.distributed import DistributedPipeline
# tests/parallel is on sys.path (pytest rootdir import)
from keras_pipeline_models import assert_weights, batches, check_set_weights_and_inference, one_process, train_pipeline

STEPS, BATCH = 3, 12  # chunks=8: micro-batches of 2, 2, 2, 2, 1, 1, 1, 1 rows
BALANCE = [2, 2, 2, 1]  # four stages of the seven layers: two per rank
HELD = {"interleaved-1f1b": [[0, 2], [1, 3]], "zb-v": [[0, 3], [1, 2]]}
hvd.init()


def deep_mlp(seed=5):
    """Dense -> tanh -> Dense -> relu -> Dense -> tanh -> Dense (7 layers): a Dense in each of the four stages."""
    init = keras.initializers.GlorotUniform
    layers = [keras.Input((6,))]
    for k, activation in enumerate(["tanh", "relu", "tanh"]):
        layers += [keras.layers.Dense(16, kernel_initializer=init(seed + k),
                                      bias_initializer=keras.initializers.RandomNormal(seed=seed + k)),
                   keras.layers.Activation(activation)]
    return keras.Sequential(layers + [keras.layers.Dense(3, kernel_initializer=init(seed + 9))])


def test_started_on_two_processes():
    assert hvd.size() == 2


def test_bad_combinations_are_refused_on_every_rank_before_communication():
    model = deep_mlp()
    with pytest.raises(ScheduleError, match=r"schedule 'zb-h1' runs one stage per rank, so it cannot run virtual_stages=2"):
        DistributedPipeline(model, BALANCE, chunks=4, schedule="zb-h1", loss_fn="mse", virtual_stages=2)
    with pytest.raises(ChunksError, match=r"interleaved-1f1b needs chunks divisible by the pipeline's ranks.*"
                                          r"\(chunks: 5, ranks: 2\)"):
        DistributedPipeline(model, BALANCE, chunks=5, schedule="interleaved-1f1b", loss_fn="mse", virtual_stages=2)
    with pytest.raises(BalanceError, match=r"balance must describe ranks x virtual_stages stages.*\(balance: 3 stages"):
        DistributedPipeline(model, [3, 2, 2], chunks=4, schedule="zb-v", loss_fn="mse", virtual_stages=2)
    functional = keras.Model(model.inputs, model.outputs)
    with pytest.raises(BalanceError, match=r"balance must describe ranks x virtual_stages stages.*\(balance: 2 stages"):
        DistributedPipeline(functional, split_points=[functional.layers[3].name], chunks=4, schedule="zb-v",
                            loss_fn="mse", virtual_stages=2)


@pytest.mark.parametrize("chunks", [4, 8])
@pytest.mark.parametrize("schedule", ["interleaved-1f1b", "zb-v"])
def test_training_equals_one_process(schedule, chunks):
    data = batches(STEPS, BATCH)
    expected_losses, expected_weights = one_process(deep_mlp(), data, keras.optimizers.SGD(0.1, momentum=0.9))
    pipe = DistributedPipeline(deep_mlp(), balance=BALANCE, chunks=chunks, schedule=schedule, loss_fn="mse",
                               virtual_stages=2)
    assert pipe.held_stages == HELD[schedule][hvd.rank()]
    assert len(pipe.trainable_variables) == 4  # each stage one Dense, each rank two stages
    train_pipeline(pipe, keras.optimizers.SGD(0.1, momentum=0.9), data, expected_losses)
    assert_weights(pipe.gather_weights(), expected_weights)
    assert [tag for tag, _, _ in pipe.records.records[-1].actions] == [str(a) for a in pipe.actions]


@pytest.mark.parametrize("schedule, checkpoint", [("interleaved-1f1b", "always"), ("zb-v", "always"),
                                                  ("zb-v", "except_last")])
def test_activation_checkpointing_equals_one_process(schedule, checkpoint):
    """Each held stage recomputes its own micro-batches in their backward (zb-v: its split passes from the replay)."""
    data = batches(STEPS, BATCH)
    expected_losses, expected_weights = one_process(deep_mlp(), data, keras.optimizers.SGD(0.1, momentum=0.9))
    pipe = DistributedPipeline(deep_mlp(), balance=BALANCE, chunks=4, schedule=schedule, loss_fn="mse",
                               virtual_stages=2, checkpoint=checkpoint)
    assert sorted(pipe.recomputes) == HELD[schedule][hvd.rank()]
    train_pipeline(pipe, keras.optimizers.SGD(0.1, momentum=0.9), data, expected_losses)
    assert_weights(pipe.gather_weights(), expected_weights)


def dropout_mlp(seed=6):
    """Dense -> Dropout(0.5) -> Dense -> Dropout(0.3) -> Dense -> Dropout(0.4) -> Dense, each Dropout seeded."""
    init = keras.initializers.GlorotUniform
    layers = [keras.Input((6,))]
    for k, rate in enumerate([0.5, 0.3, 0.4]):
        layers += [keras.layers.Dense(16, kernel_initializer=init(seed + k)), keras.layers.Dropout(rate, seed=seed + k)]
    return keras.Sequential(layers + [keras.layers.Dense(3, kernel_initializer=init(seed + 9))])


@pytest.mark.parametrize("schedule", ["interleaved-1f1b", "zb-v"])
def test_checkpointing_replays_each_stages_dropout_masks(schedule):
    """A replayed forward draws its stage's masks from the seeds its first forward found, whatever the rank's other
    stage drew between: the gradients equal checkpoint="never"'s from the same seeds."""
    x, y = batches(1, BATCH)[0]
    gradients = {}
    for checkpoint in ("never", "always"):
        pipe = DistributedPipeline(dropout_mlp(), balance=BALANCE, chunks=4, schedule=schedule, loss_fn="mse",
                                   virtual_stages=2, checkpoint=checkpoint)
        pipe.train_step(x if pipe.is_first else None, y if pipe.is_last else None)
        gradients[checkpoint] = [g.numpy() for g in pipe.gradients]
    assert len(gradients["never"]) == len(gradients["always"]) == 4  # each stage one Dense, kernel and bias: 2 x 2
    for k, (got, want) in enumerate(zip(gradients["always"], gradients["never"])):
        assert np.abs(want).sum() > 0, f"rank {hvd.rank()}: gradient {k} is zero"
        np.testing.assert_allclose(got, want, atol=1e-6, rtol=0, err_msg=f"rank {hvd.rank()}: gradient {k}")


def deep_functional(seed=5):
    """``deep_mlp`` as a functional model, cut before each Dense but the first: four stages of one Dense each."""
    model = deep_mlp(seed)
    functional = keras.Model(model.inputs, model.outputs)
    return functional, [functional.layers[k].name for k in (3, 5, 7)]


@pytest.mark.parametrize("chunks", [4, 8])
@pytest.mark.parametrize("schedule", ["interleaved-1f1b", "zb-v"])
def test_functional_model_with_virtual_stages_equals_one_process(schedule, chunks):
    """A functional model's graph split into ranks x 2 stages: its edges' links, the schedule's placement."""
    data = batches(STEPS, BATCH)
    expected_losses, expected_weights = one_process(deep_mlp(), data, keras.optimizers.SGD(0.1, momentum=0.9))
    model, split_points = deep_functional()
    pipe = DistributedPipeline(model, split_points=split_points, chunks=chunks, schedule=schedule, loss_fn="mse",
                               virtual_stages=2)
    assert pipe.held_stages == HELD[schedule][hvd.rank()]
    assert len(pipe.trainable_variables) == 4 and set(pipe._graph_functions) == set(pipe.held_stages)
    train_pipeline(pipe, keras.optimizers.SGD(0.1, momentum=0.9), data, expected_losses)
    assert_weights(pipe.gather_weights(), expected_weights)
    assert [tag for tag, _, _ in pipe.records.records[-1].actions] == [str(a) for a in pipe.actions]
    other, _ = deep_functional(seed=99)
    check_set_weights_and_inference(pipe, other, rows=8)


def tied_ends(seed=3):
    """x -> Dense "shared" (tanh) -> Dense b, c, d (tanh) -> "shared" again: cut before b, c and d, the first and
    the last of the four stages read the same kernel and bias."""
    init = keras.initializers.GlorotUniform
    x = keras.Input((6,))
    shared = keras.layers.Dense(6, activation="tanh", name="shared", kernel_initializer=init(seed),
                                bias_initializer=keras.initializers.RandomNormal(seed=seed))
    h = shared(x)
    for k, name in enumerate("bcd"):
        h = keras.layers.Dense(6, activation="tanh", name=name, kernel_initializer=init(seed + 1 + k))(h)
    return keras.Model(x, shared(h))


@pytest.mark.parametrize("schedule", ["interleaved-1f1b", "zb-v"])
def test_weights_read_by_the_first_and_the_last_stage_train_as_one_process(schedule):
    """interleaved-1f1b: stages 0 and 3 on ranks 0 and 1 hold copies, their gradients summed between the ranks;
    zb-v: both on rank 0, one variable whose two stages' shares add up there."""
    data = batches(STEPS, BATCH, outputs=6)
    expected_losses, expected_weights = one_process(tied_ends(), data, keras.optimizers.SGD(0.1, momentum=0.9))
    model = tied_ends()
    if hvd.rank() == 1:  # rank 1's copy starts elsewhere: the pipeline makes it stage 0's
        model.get_layer("shared").kernel.assign_add(np.ones((6, 6), "float32"))
    pipe = DistributedPipeline(model, split_points=["b", "c", "d"], chunks=4, schedule=schedule, loss_fn="mse",
                               virtual_stages=2)
    assert [w.stages for w in pipe.tied.plan.tied] == ([(0, 1)] * 2 if schedule == "interleaved-1f1b" else [])
    # interleaved's rank 1: b, d and its copy of "shared"; zb-v's rank 0: "shared" once, though stages 0 and 3 read it
    assert len(pipe.trainable_variables) == (6 if schedule == "interleaved-1f1b" and hvd.rank() == 1 else 4)
    train_pipeline(pipe, keras.optimizers.SGD(0.1, momentum=0.9), data, expected_losses)
    assert_weights(pipe.gather_weights(), expected_weights)


def test_inference_and_set_weights_of_a_chain():
    model, other = deep_mlp(), deep_mlp(seed=99)
    pipe = DistributedPipeline(model, balance=BALANCE, chunks=4, schedule="zb-v", loss_fn="mse", virtual_stages=2)
    check_set_weights_and_inference(pipe, other, rows=8)


@pytest.mark.parametrize("schedule", ["interleaved-1f1b", "zb-v"])
def test_stage_checkpoint_resumes_and_merges_into_the_model(schedule, tmp_path):
    """Each rank's part holds its two stages; a resumed run equals the straight one, the merge the one-process model."""
    folder = hvd.broadcast_object(str(tmp_path), 0, name=f"vstages.ckpt.{schedule}")  # one folder for all ranks
    ckpt, data = os.path.join(folder, "ckpt"), batches(STEPS, BATCH)
    expected_losses, expected_weights = one_process(deep_mlp(), data, keras.optimizers.SGD(0.1, momentum=0.9))

    def build(seed):
        pipe = DistributedPipeline(deep_mlp(seed), BALANCE, chunks=4, schedule=schedule, loss_fn="mse",
                                   virtual_stages=2)
        return pipe, keras.optimizers.SGD(0.1, momentum=0.9)

    pipe, optimizer = build(5)
    train_pipeline(pipe, optimizer, data[:2], expected_losses)
    np.random.seed(100 + hvd.rank())  # each rank its own numpy stream, saved with its part
    hvd.save_stage_checkpoint(ckpt, pipe, optimizer, step=1, data_position={"next_step": 2})
    saved, draw = pipe.get_weights(), np.random.rand(3)
    assert sorted(os.listdir(ckpt)) == ["stage-0", "stage-1"]  # one part per rank, holding its two stages
    pipe, optimizer = build(99)  # other weights, optimizer not built (no momentum yet)
    np.random.seed(999)
    state = hvd.load_stage_checkpoint(ckpt, pipe, optimizer)
    assert state.step == 1 and state.data_position == {"next_step": 2}
    assert_weights(pipe.get_weights(), saved, "loaded vs saved", atol=0)
    np.testing.assert_array_equal(np.random.rand(3), draw, err_msg=f"rank {hvd.rank()}: RNG not restored")
    train_pipeline(pipe, optimizer, data[2:], expected_losses[2:])  # the momentum came back too
    hvd.save_stage_checkpoint(ckpt, pipe, optimizer, step=2)
    mine = os.path.join(folder, f"full-{hvd.rank()}.npz")  # every rank merges its copy (no communication)
    hvd.merge_stage_checkpoints(ckpt, mine)
    full = deep_mlp(99)
    hvd_keras.load_checkpoint(mine, full, restore_rng=False)  # a collective: rank 0 reads its copy
    assert_weights(full.get_weights(), expected_weights, "merged vs one process", atol=1e-5)
    again, _ = build(77)  # rank 0 reads its merged file, each rank takes its two stages' blocks
    assert hvd.load_stage_checkpoint(os.path.join(folder, "full-0.npz"), again).step == 2
    assert_weights(again.get_weights(), pipe.get_weights(), "taken from the merged file", atol=0)
