"""Whether a Keras process stage compiles with XLA (dualframe.tensorflow.pipeline.xla): asked for, or chosen per stage."""
import keras
import pytest

from dualframe.tensorflow.graph.capture import capture
from dualframe.tensorflow.pipeline.graph import process_stages
from dualframe.tensorflow.pipeline.xla import use_xla


def built(*layers, shape=(4,)):
    model = keras.Sequential([keras.Input(shape), *layers])
    return list(model.layers)


@pytest.mark.parametrize("layers, chosen", [
    (built(keras.layers.Dense(4, activation="relu"), keras.layers.ReLU(), keras.layers.Dense(2)), True),
    (built(keras.layers.Conv2D(4, 3), keras.layers.Flatten(), keras.layers.Dense(2), shape=(6, 6, 3)), False),
    (built(keras.layers.Dense(4), keras.layers.LayerNormalization()), False),
    ([keras.layers.Dense(4), keras.layers.Conv1D(2, 1)], False),  # not built yet: Conv1D will hold weights
])
def test_by_default_only_dense_stages_compile_with_xla_on_a_cpu(layers, chosen):
    assert use_xla(None, layers, "/CPU:0") is chosen
    assert use_xla(None, layers, "/GPU:0") is True  # as Keras's fit decides: XLA on a GPU
    assert use_xla(False, layers, "/CPU:0") is False and use_xla(True, layers, "/CPU:0") is True


def test_a_stage_with_dropout_never_compiles_with_xla():
    assert use_xla(True, built(keras.layers.Dense(4), keras.layers.Dropout(0.1)), "/CPU:0") is False
    assert use_xla(True, built(keras.layers.Dense(4), keras.layers.Dropout(0.0)), "/CPU:0") is True  # draws nothing


def test_a_graph_stage_is_judged_by_the_layers_it_holds():
    x = keras.Input((4,))
    h = keras.layers.Dense(4, name="d0")(x)
    h = keras.layers.Add(name="add")([h, keras.layers.Dense(4, name="d1")(h)])
    model = keras.Model(x, keras.layers.Reshape((2, 2), name="r")(keras.layers.Dense(4, name="d2")(h)))
    _, stages = process_stages(capture(model), split_points=["d2"])
    assert [use_xla(None, [stage], None) for stage in stages] == [True, True]
