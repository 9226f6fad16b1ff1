"""A pipeline stage's compiled optimizer update (dualframe.tensorflow.pipeline.optimizer.compiled_apply) equals Keras's eager one."""
import keras
import numpy as np
import pytest
import tensorflow as tf

from dualframe.tensorflow.pipeline.optimizer import compiled_apply


@pytest.mark.parametrize("name", ["SGD", "Adam"])
def test_compiled_update_equals_eager_apply_gradients(name):
    rng = np.random.default_rng(0)
    start = [rng.standard_normal((4, 3)).astype("float32"), rng.standard_normal(3).astype("float32"),
             rng.standard_normal((3, 2)).astype("float32")]
    eager_vars, compiled_vars = [keras.Variable(v) for v in start], [keras.Variable(v) for v in start]
    eager, compiled = getattr(keras.optimizers, name)(0.1), getattr(keras.optimizers, name)(0.1)
    for step in range(3):
        grads = [tf.constant(rng.standard_normal(v.shape).astype("float32")) for v in start]
        grads[1] = None if step == 1 else grads[1]  # a variable not connected to the loss this step
        chosen = [(g, i) for i, g in enumerate(grads) if g is not None]
        eager.apply_gradients([(g, eager_vars[i]) for g, i in chosen])
        update = compiled_apply(compiled, compiled_vars, [compiled_vars[i] for _, i in chosen])
        update([g for g, _ in chosen])
    for a, b in zip(eager_vars, compiled_vars):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-6, atol=1e-6)
    assert int(compiled.iterations.numpy()) == 3
    assert not np.allclose(compiled_vars[0].numpy(), start[0])


def test_wrapped_optimizers_stay_eager():
    class Wrapped:  # a wrapper from elsewhere (Horovod's, dualframe's) reduces outside any function
        pass
    assert compiled_apply(Wrapped(), [], []) is None
