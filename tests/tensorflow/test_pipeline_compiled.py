"""A stage's compiled pass (dualframe.tensorflow.pipeline.compiled.CompiledPass) picks the right trace on its short way."""
import numpy as np
import pytest
import tensorflow as tf

from dualframe.tensorflow.pipeline.compiled import CompiledPass


def _body(values, weight, sums, training):
    scale = 2.0 if training else 3.0
    out = {name: v * scale * tf.cast(weight, v.dtype) for name, v in values.items()}
    return out, None if sums is None else [s + 1.0 for s in sums]


@pytest.mark.parametrize("jit_compile", [False, True])
def test_short_way_equals_tf_function_and_traces_once_per_kind(jit_compile):
    compiled = CompiledPass(_body, jit_compile)
    plain = tf.function(_body)
    w = tf.constant(0.5, tf.float64)
    calls = [({"a": tf.ones((2, 3))}, w, None, True), ({"a": tf.ones((2, 3))}, w, [tf.zeros(4)], True),
             ({"a": tf.ones((2, 3))}, w, [tf.zeros(4)], False), ({"b": tf.ones((2, 3))}, w, [tf.zeros(4)], True),
             ({"a": tf.ones((5, 3))}, w, [tf.zeros(4)], True)]
    for _ in range(2):
        for args in calls:
            got, want = compiled(*args), plain(*args)
            for g, e in zip(tf.nest.flatten(got), tf.nest.flatten(want), strict=True):
                assert (g is None) == (e is None)
                if g is not None:
                    np.testing.assert_allclose(g.numpy(), e.numpy())
    assert len(compiled._traced) == len(calls)  # one per dict keys, None, flag and shape; none again
    count = compiled.tracing_count()
    compiled(*calls[1])
    assert compiled.tracing_count() == count
