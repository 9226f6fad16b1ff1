"""Splitting any functional Keras model: outputs, loss and gradients equal the unsplit model's, weights load both ways.

The split runs the model's own layers, so the reference is the same model object. BatchNormalization
runs in training mode: with micro-batches it normalises each micro-batch over its own rows, so the
reference is the unsplit model fed the same micro-batches (concatenated); with one micro-batch, the
whole batch. Inference mode compares against the unsplit model on the whole batch.
"""
import os

import numpy as np
import pytest
import keras
import tensorflow as tf

import dualframe.tensorflow as hvd
from dualframe.errors import BalanceError, SplitPointError, StrategyError, TraceError
from dualframe.pipeline.microbatch import micro_batch_sizes

T, VOCAB = 6, 30


def resnet(seed=0, bn=True, classes=5):
    """stem -> block (identity skip) -> block (projection skip) -> pooled logits."""
    keras.utils.set_random_seed(seed)
    x = keras.Input((8, 8, 3), name="image")
    h = keras.layers.Conv2D(8, 3, padding="same", activation="relu", name="stem")(x)

    def block(h, name, width, stride):
        y = keras.layers.Conv2D(width, 3, strides=stride, padding="same", name=f"{name}_conv1")(h)
        y = keras.layers.BatchNormalization(name=f"{name}_bn1")(y) if bn else y
        y = keras.layers.Activation("relu", name=f"{name}_relu")(y)
        y = keras.layers.Conv2D(width, 3, padding="same", name=f"{name}_conv2")(y)
        if stride > 1:
            h = keras.layers.Conv2D(width, 1, strides=stride, name=f"{name}_proj")(h)
        return keras.layers.Activation("relu", name=f"{name}_out")(keras.layers.Add(name=f"{name}_add")([y, h]))

    h = block(h, "block1", 8, 1)
    h = block(h, "block2", 16, 2)
    h = keras.layers.GlobalAveragePooling2D(name="pool")(h)
    return keras.Model(x, keras.layers.Dense(classes, name="logits")(h), name="small_resnet")


def encoder(seed=0, blocks=3, width=8):
    """(tokens, padding mask) -> embedding -> blocks that all read one attention mask -> (logits, features)."""
    keras.utils.set_random_seed(seed)
    tokens = keras.Input((T,), dtype="int32", name="tokens")
    mask = keras.Input((T,), dtype="bool", name="mask")
    attention = keras.layers.Reshape((1, T), name="attention_mask")(mask)
    h = keras.layers.Embedding(VOCAB, width, name="embed")(tokens)
    for b in range(blocks):
        a = keras.layers.MultiHeadAttention(2, width // 2, name=f"b{b}_mha")(h, h, attention_mask=attention)
        h = keras.layers.LayerNormalization(name=f"b{b}_ln1")(keras.layers.Add(name=f"b{b}_add1")([h, a]))
        f = keras.layers.Dense(2 * width, activation="relu", name=f"b{b}_ff1")(h)
        f = keras.layers.Dense(width, name=f"b{b}_ff2")(f)
        h = keras.layers.LayerNormalization(name=f"b{b}_ln2")(keras.layers.Add(name=f"b{b}_add2")([h, f]))
    features = keras.layers.GlobalAveragePooling1D(name="features")(h)
    logits = keras.layers.Dense(3, name="head")(features)
    return keras.Model({"tokens": tokens, "mask": mask}, [logits, features], name="encoder")


def encoder_batch(rows, seed=0):
    rng = np.random.RandomState(seed)
    lengths = rng.randint(2, T + 1, size=rows)
    return {"tokens": tf.constant(rng.randint(1, VOCAB, size=(rows, T)), tf.int32),
            "mask": tf.constant(np.arange(T)[None, :] < lengths[:, None])}


def loss_of(outputs):
    flat = outputs if isinstance(outputs, (list, tuple)) else [outputs]
    return sum(tf.reduce_mean(tf.square(y - 0.1)) for y in flat)


def rows_of(inputs, sizes):
    """The micro-batches of ``inputs`` (a tensor or a dict of tensors)."""
    if isinstance(inputs, dict):
        parts = {k: tf.split(v, sizes) for k, v in inputs.items()}
        return [{k: parts[k][i] for k in inputs} for i in range(len(sizes))]
    return tf.split(inputs, sizes)


def run(model, inputs, chunks=1, training=True):
    """Outputs, loss and gradients (float inputs, then trainable variables); ``chunks`` > 1: the unsplit model
    fed the pipeline's micro-batches, outputs concatenated."""
    float_inputs = [v for v in tf.nest.flatten(inputs) if v.dtype.is_floating]
    with tf.GradientTape() as tape:
        tape.watch(float_inputs)
        if chunks == 1:
            outputs = model(inputs, training=training)
        else:
            rows = tf.nest.flatten(inputs)[0].shape[0]
            pieces = [model(part, training=training) for part in rows_of(inputs, micro_batch_sizes(rows, chunks))]
            outputs = tf.nest.map_structure(lambda *ys: tf.concat(ys, 0), *pieces)
        loss = loss_of(outputs)
    return outputs, loss, tape.gradient(loss, float_inputs + model.trainable_variables)


def assert_same(got, want, atol=1e-5):
    (out, loss, grads), (ref_out, ref_loss, ref_grads) = got, want
    for a, b in zip(tf.nest.flatten(out), tf.nest.flatten(ref_out)):
        np.testing.assert_allclose(a.numpy(), b.numpy(), atol=atol, rtol=0)
    np.testing.assert_allclose(float(loss), float(ref_loss), atol=atol, rtol=0)
    assert len(grads) == len(ref_grads)
    for a, b in zip(grads, ref_grads):
        np.testing.assert_allclose(tf.convert_to_tensor(a).numpy(), tf.convert_to_tensor(b).numpy(), atol=atol, rtol=0)


CUTS = [dict(split_points=["block2_conv1"]), dict(split_points=["block1_bn1", "block2_add"]),
        dict(balance=[3, 10, 4]), dict(stages=2, by="memory")]


@pytest.mark.parametrize("cut", CUTS, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
@pytest.mark.parametrize("chunks, batch, checkpoint", [(1, 6, "never"), (3, 10, "always"), (4, 10, "except_last")])
def test_resnet_split_equals_the_unsplit_model(cut, chunks, batch, checkpoint):
    model = resnet()
    x = tf.random.normal((batch, 8, 8, 3), seed=3)
    want = run(model, x, chunks)
    stages = len(cut.get("balance", cut.get("split_points", [0]) + [0]) if "stages" not in cut else [0, 0])
    pipe = hvd.Pipeline(model, devices=[f"/CPU:{j + 1}" for j in range(stages)], chunks=chunks,
                        checkpoint=checkpoint, **cut)
    assert_same(run(pipe, x), want)
    np.testing.assert_allclose(pipe(x, training=False).numpy(), model(x, training=False).numpy(), atol=1e-5, rtol=0)


def test_stages_by_time_on_a_sample_equals_the_unsplit_model_and_keeps_batch_norm_statistics():
    model = resnet()
    x = tf.random.normal((6, 8, 8, 3), seed=4)
    moving = [v.numpy() for v in model.non_trainable_weights]
    pipe = hvd.Pipeline(model, stages=3, sample=x, chunks=2)
    for a, b in zip(moving, model.non_trainable_weights):
        np.testing.assert_array_equal(a, b.numpy())  # measuring left the moving statistics as they were
    assert len(pipe.balance) == 3 and sum(pipe.balance) == len(model.layers)
    assert_same(run(pipe, x), run(model, x, chunks=2))


def test_stages_by_time_measures_a_model_with_an_embedding():
    # an Embedding's gradient is IndexedSlices: measuring it must not stop there
    model, x = encoder(), encoder_batch(6)
    pipe = hvd.Pipeline(model, stages=2, sample=x, chunks=2)
    assert len(pipe.balance) == 2 and sum(pipe.balance) == len(model.layers)
    assert_same(run(pipe, x), run(model, x, chunks=2))


def test_variables_live_on_their_stage_device_and_describe_shows_the_crossing_tensors():
    model = resnet()
    split = hvd.ModelParallel(model, split_points=["block1_conv2"], devices=["/CPU:1", "/CPU:2"])
    names = [layer.name for layer in model.layers]
    for layer in model.layers:
        device = "/CPU:1" if names.index(layer.name) < names.index("block1_conv2") else "/CPU:2"
        for v in layer.weights:
            assert v.value.device.endswith(device.replace("/", "device:")), (layer.name, v.value.device)
    assert split.split_points == ("block1_conv2",)
    assert split.graph_split.crossing(0) == ("stem", "block1_relu")  # the skip tensor and the main path
    text = split.describe()
    assert "split points: block1_conv2" in text and "boundary 0|1: 2 tensors, 4.0 KiB/sample" in text, text
    assert "stem" in text and "(None, 8, 8, 8)" in text and "2.0 KiB/sample  -> stage 1" in text, text
    x = tf.random.normal((4, 8, 8, 3))
    np.testing.assert_allclose(split(x, training=False).numpy(), model(x, training=False).numpy(), atol=1e-6)


def test_weights_keep_the_model_order_and_load_both_ways(tmp_path):
    model, other = resnet(seed=0), resnet(seed=1)
    split = hvd.ModelParallel(model, balance=[8, 9], devices=["/CPU:1", "/CPU:2"])
    assert [v.path for v in split.weights] == [v.path for v in model.weights]
    assert [v.path for v in split.trainable_variables] == [v.path for v in model.trainable_variables]
    x = tf.random.normal((3, 8, 8, 3))
    split.set_weights(other.get_weights())
    np.testing.assert_allclose(split(x, training=False).numpy(), other(x, training=False).numpy(), atol=1e-6)
    path = str(tmp_path / "split.weights.h5")
    fresh = resnet(seed=2)
    split.save_weights(path)
    fresh.load_weights(path)
    for a, b in zip(fresh.get_weights(), other.get_weights()):
        np.testing.assert_array_equal(a, b)
    resnet(seed=3).save_weights(path)
    split.load_weights(path)
    for a, b in zip(split.get_weights(), resnet(seed=3).get_weights()):
        np.testing.assert_array_equal(a, b)


def test_fit_equals_the_unsplit_model_with_an_uneven_last_batch():
    model, reference = resnet(bn=False), resnet(bn=False, seed=5)
    reference.set_weights(model.get_weights())
    pipe = hvd.Pipeline(model, split_points=["block2_conv1"], devices=["/CPU:1", "/CPU:2"], chunks=4)
    rng = np.random.RandomState(0)
    x, y = rng.randn(22, 8, 8, 3).astype("float32"), rng.randn(22, 5).astype("float32")
    for m in (pipe, reference):
        m.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
        m.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)  # batches 8, 8, 6
    for a, b in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)


@pytest.mark.parametrize("cut, chunks, batch, checkpoint", [
    (dict(split_points=["b1_mha", "b2_mha"]), 3, 7, "always"),
    (dict(split_points=["b0_ff1"]), 4, 9, "except_last"),
    (dict(balance=[9, 9, 9]), 1, 5, "never"),
    (dict(stages=2, by="memory"), 3, 6, "except_last"),
])
def test_encoder_with_a_mask_every_block_reads_equals_the_unsplit_model(cut, chunks, batch, checkpoint):
    model = encoder()
    inputs = encoder_batch(batch)
    want = run(model, inputs, chunks)
    pipe = hvd.Pipeline(model, chunks=chunks, checkpoint=checkpoint, **cut)
    assert_same(run(pipe, inputs), want)


@pytest.mark.parametrize("checkpoint", ["always", "never"])
def test_encoder_in_a_tf_function_with_unknown_batch(checkpoint):
    model = encoder()
    pipe = hvd.Pipeline(model, split_points=["b1_mha"], devices=["/CPU:1", "/CPU:2"], chunks=3,
                        checkpoint=checkpoint)
    spec = {"tokens": tf.TensorSpec((None, T), tf.int32), "mask": tf.TensorSpec((None, T), tf.bool)}
    step = tf.function(lambda inputs: run(pipe, inputs), input_signature=[spec])
    for batch in (9, 7):
        inputs = encoder_batch(batch, seed=batch)
        assert_same(step(inputs), run(model, inputs, chunks=3))


def test_eager_timeline_records_every_cell_of_a_graph_split():
    model = resnet()
    pipe = hvd.Pipeline(model, split_points=["block2_conv1"], devices=["/CPU:1", "/CPU:2"], chunks=3)
    x = tf.random.normal((6, 8, 8, 3))
    pipe(x)
    with pipe.record() as timeline:
        got = run(pipe, x)
    assert_same(got, run(model, x, chunks=3))
    assert sorted((e.kind, e.micro_batch, e.stage) for e in timeline.events) == sorted(
        (k, i, j) for k in "FB" for i in range(3) for j in range(2))


def test_the_mask_goes_to_each_stage_that_reads_it_and_nowhere_else():
    split = hvd.ModelParallel(encoder(), split_points=["b1_mha", "b2_mha", "features"])
    s = split.graph_split
    assert s.graph.inputs == ("mask", "tokens")
    assert [("attention_mask" in r) for r in s.reads] == [False, True, True, False]
    assert ("attention_mask", 1) in s.messages(0) and ("attention_mask", 2) in s.messages(0)  # straight from stage 0
    assert all(v != "attention_mask" for v, _ in s.messages(1))
    assert s.outputs_from(3) == ("head", "features")
    assert "attention_mask" in split.describe()


def test_resnet50_balance_90_87_builds_and_matches_the_unsplit_forward():
    model = keras.applications.ResNet50(weights=None, input_shape=(32, 32, 3), classes=10)
    split = hvd.ModelParallel(model, balance=[90, 87], devices=["/CPU:1", "/CPU:2"])
    assert split.balance == [90, 87] and split.split_points == (model.layers[90].name,)
    x = tf.random.normal((2, 32, 32, 3))
    np.testing.assert_allclose(split(x, training=False).numpy(), model(x, training=False).numpy(), atol=1e-5)
    assert "boundary 0|1" in split.describe()


def test_sequential_and_lists_split_as_chains():
    keras.utils.set_random_seed(0)
    seq = keras.Sequential([keras.Input((4,)), keras.layers.Dense(5, name="d1"), keras.layers.Dense(3, name="d2"),
                            keras.layers.Dense(2, name="d3")])
    split = hvd.Pipeline(seq, split_points=["d3"], chunks=2)
    x = tf.random.normal((5, 4))
    assert split.balance == [2, 1]
    assert_same(run(split, x), run(seq, x))


class Subclassed(keras.Model):
    def __init__(self):
        super().__init__()
        self.dense = keras.layers.Dense(2)

    def call(self, x):
        return self.dense(x)


def shared():
    x = keras.Input((4,), name="x")
    twice = keras.layers.Dense(4, name="twice")
    h = keras.layers.Dense(4, name="between")(twice(x))
    return keras.Model(x, twice(h))


def nested():
    inner_in = keras.Input((4,))
    inner = keras.Model(inner_in, keras.layers.Dense(4, name="inside")(inner_in), name="inner")
    x = keras.Input((4,), name="x")
    return keras.Model(x, keras.layers.Dense(2, name="after")(inner(keras.layers.Dense(4, name="before")(x))))


@pytest.mark.parametrize("make, kwargs, error, message", [
    (resnet, dict(split_points=["block2_conv"]), SplitPointError,
     r"unknown split point 'block2_conv' \(split_points\[0\]\).*did you mean .*'block2_conv1'"),
    (resnet, dict(split_points=["block2_conv1", "block1_conv1"]), SplitPointError,
     r"split points must follow execution order: 'block1_conv1'"),
    (resnet, dict(split_points=["image"]), SplitPointError, r"'image' .* is where the model begins"),
    (shared, dict(split_points=["twice"]), SplitPointError, r"'twice' .* runs in more than one place"),
    (nested, dict(split_points=["inside"]), SplitPointError,
     r"'inside' .* inside the nested model 'inner', which runs as one piece"),
    (resnet, dict(balance=[1] * 18), BalanceError, r"balance: \[1, 1, .*layers: 17"),
    (resnet, dict(stages=18), BalanceError, r"more stages than there are places to cut: 17 top-level units"),
    (resnet, dict(stages=2), StrategyError, r"stages= with by='time' measures .* pass sample="),
    (resnet, dict(stages=2, by="speed", sample=np.zeros((2, 8, 8, 3), "float32")), StrategyError,
     r"by must be one of 'time', 'memory' \(by: 'speed'\)"),
    (resnet, dict(), BalanceError, r"give exactly one of split_points=.*given: none"),
    (Subclassed, dict(balance=[1]), TraceError, r"Subclassed is a subclassed keras.Model.*functional API.*list of"),
])
def test_bad_input_refused_before_any_compute(make, kwargs, error, message):
    model = make()
    before = [v.value.device for v in model.weights]
    with pytest.raises(error, match=message):
        hvd.Pipeline(model, devices=["/CPU:1", "/CPU:2"] if "stages" in kwargs or kwargs.get("split_points")
                     and len(kwargs["split_points"]) == 1 else None, **kwargs)
    assert [v.value.device for v in model.weights] == before  # nothing moved


def test_a_shared_layer_runs_as_twice_and_still_splits_elsewhere():
    model = shared()
    split = hvd.ModelParallel(model, split_points=["between"], devices=["/CPU:1", "/CPU:2"])
    assert [n.name for n in split.graph_split.graph.nodes] == ["x", "twice@0", "between", "twice@1"]
    x = tf.random.normal((3, 4))
    assert_same(run(split, x), run(model, x))


def test_a_nested_model_is_one_leaf():
    model = nested()
    split = hvd.Pipeline(model, split_points=["inner"], chunks=2)
    assert [n.leaf for n in split.graph_split.graph.nodes] == [False, False, True, False]
    x = tf.random.normal((4, 4))
    assert_same(run(split, x), run(model, x))


if os.environ.get("DUALFRAME_SLOW"):  # pragma: no cover - the same check on the full-size model's training step
    def test_resnet50_gradients_equal_the_unsplit_model():
        model = keras.applications.ResNet50(weights=None, input_shape=(32, 32, 3), classes=10)
        x = tf.random.normal((4, 32, 32, 3))
        pipe = hvd.Pipeline(model, balance=[90, 87], chunks=2, checkpoint="never")
        assert_same(run(pipe, x), run(model, x, chunks=2), atol=1e-4)


def gated():
    """A boolean tensor crosses beside a float one when cut at d2."""
    x = keras.Input((4,), name="x")
    d1 = keras.layers.Dense(8, name="d1")(x)
    positive = keras.layers.Lambda(lambda t: t > 0, name="positive")(d1)
    d2 = keras.layers.Dense(8, name="d2")(d1)
    gate = keras.layers.Lambda(lambda a: a[0] * tf.cast(a[1], "float32"), name="gate")([d2, positive])
    return keras.Model(x, keras.layers.Dense(2, name="head")(gate))


def walk_in_one_process(model, balance, inputs, chunks=1):
    """DistributedPipeline's stages of ``model``, run in one process along the graph's edges (GPipe order):
    the model's outputs, loss and variable gradients (in ``model.trainable_variables`` order), and the edges."""
    from dualframe.pipeline.graph_walk import edge_pairs
    from dualframe.tensorflow.graph.capture import capture
    from dualframe.tensorflow.pipeline.graph import process_stages
    from dualframe.tensorflow.pipeline.graph_work import TFGraphStageWork

    captured = capture(model)
    split, stages = process_stages(captured, balance=balance)
    rows = tf.nest.flatten(inputs)[0].shape[0]
    sizes = micro_batch_sizes(rows, chunks)
    micro = rows_of(dict(zip(split.graph.inputs, captured.flat_inputs(inputs))), sizes)
    works = [TFGraphStageWork(stage, split, j, captured, lambda _, out: loss_of(out), [None] * chunks,
                              [s / rows for s in sizes]) for j, stage in enumerate(stages)]
    forward, backward = {}, {}
    for i in range(chunks):
        for j, work in enumerate(works):
            received = {p: forward[(p, j, i)] for p in work.incoming}
            if j == 0:
                received[-1] = micro[i]
            forward.update({(j, c, i): m for c, m in work.forward(i, received).items()})
    for i in range(chunks):
        for j in reversed(range(len(works))):
            grads = {c: backward[(j, c, i)] for c in works[j].outgoing}
            backward.update({(p, j, i): m for p, m in works[j].backward(i, grads).items()})
    by_path = {v.path: g for stage, work in zip(stages, works) for v, g in zip(stage.trainable_weights, work.step_gradients())}
    assert [v.path for s in stages for v in s.weights] == [v.path for v in model.weights]
    return works[-1].loss_sum, [by_path[v.path] for v in model.trainable_variables], edge_pairs(split)


@pytest.mark.parametrize("make, balance, x, edges", [
    (lambda: resnet(bn=False), [3, 1, 11], tf.random.normal((5, 8, 8, 3), seed=6), [(0, 1), (0, 2), (1, 2)]),
    (gated, [3, 3], tf.random.normal((5, 4), seed=7), [(0, 1)]),                       # a bool beside a float
    (encoder, [9, 9, 9], None, [(0, 1), (0, 2), (1, 2)]),  # two outputs, the mask skips stage 1, two int/bool inputs
])
@pytest.mark.parametrize("chunks", [1, 2])
def test_process_stages_along_edges_equal_the_model(make, balance, x, edges, chunks):
    """What DistributedPipeline's stages run and send, in one process: loss and gradients equal the model's."""
    model = make()
    x = encoder_batch(6) if x is None else x
    loss, grads, got_edges = walk_in_one_process(model, balance, x, chunks)
    assert got_edges == edges
    rows = tf.nest.flatten(x)[0].shape[0]
    want_loss, want_grads = 0.0, [0.0] * len(grads)
    for part, size in zip(rows_of(x, micro_batch_sizes(rows, chunks)), micro_batch_sizes(rows, chunks)):
        _, l, g = run(model, part)
        g = g[len([v for v in tf.nest.flatten(part) if v.dtype.is_floating]):]
        want_loss += float(l) * size / rows
        want_grads = [a + tf.convert_to_tensor(b) * size / rows for a, b in zip(want_grads, g)]
    np.testing.assert_allclose(loss, want_loss, atol=1e-5, rtol=0)
    for a, b in zip(grads, want_grads):  # an Embedding's gradient stays IndexedSlices
        np.testing.assert_allclose(np.asarray(tf.convert_to_tensor(a)), np.asarray(b), atol=1e-5, rtol=0)


def test_messages_carry_every_dtype_exactly():
    from dualframe.tensorflow.pipeline.message import pack, unpack

    values = [tf.constant([[2 ** 53 + 1, -7]], tf.int64), tf.constant([True, False, True]),
              tf.constant(np.arange(7, dtype=np.uint8)), tf.random.normal((2, 3, 1)), tf.constant(2 ** 31 - 1, tf.int32),
              tf.constant([1.5, -2.25], tf.bfloat16), tf.zeros((0, 4))]
    message = pack(values, [f"v{k}" for k in range(len(values))])
    assert message.dtype == tf.uint8
    for got, want in zip(unpack(message), values):
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(got.numpy(), want.numpy())
    with pytest.raises(StrategyError, match=r"value 'n' crosses between process stages but is a int"):
        pack([3], ["n"])


def test_fit_with_dict_inputs_and_two_outputs_equals_the_unsplit_model():
    model, reference = encoder(seed=0), encoder(seed=1)
    reference.set_weights(model.get_weights())
    pipe = hvd.Pipeline(model, split_points=["b1_mha"], devices=["/CPU:1", "/CPU:2"], chunks=3)
    inputs = {k: v.numpy() for k, v in encoder_batch(15).items()}
    rng = np.random.RandomState(2)
    targets = [rng.randn(15, 3).astype("float32"), rng.randn(15, 8).astype("float32")]
    for m in (pipe, reference):
        m.compile(optimizer=keras.optimizers.SGD(0.05), loss=["mse", "mse"])
        m.fit(inputs, targets, batch_size=6, epochs=1, shuffle=False, verbose=0)  # batches 6, 6, 3
    for a, b in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)


def test_a_list_of_layers_split_by_measured_time_lands_on_its_devices():
    keras.utils.set_random_seed(0)
    parts = [keras.layers.Dense(16, activation="relu", name=f"d{k}") for k in range(4)] + [keras.layers.Dense(2)]
    x = tf.random.normal((6, 8))
    pipe = hvd.Pipeline(parts, stages=2, sample=x.numpy(), devices=["/CPU:1", "/CPU:2"], chunks=2)
    for r, device in zip(pipe.plan.ranges, pipe.devices):
        for index in r:
            assert all(v.value.device.endswith(device.replace("/", "device:")) for v in parts[index].weights)
    assert "boundary 0|1: 1 tensor" in pipe.describe()
    reference = keras.Sequential([keras.Input((8,))] + [keras.layers.Dense(16, "relu") for _ in range(4)]
                                 + [keras.layers.Dense(2)])
    reference.set_weights(pipe.get_weights())
    assert_same(run(pipe, x), run(reference, x))
