"""TensorFlow test setup: 4 logical CPU devices (/CPU:0 ... /CPU:3), made before TensorFlow initializes; a float64 Keras fixture.

Model-split tests place layer groups on /CPU:1 ... ; other tests are unaffected (ops still default
to /CPU:0). This must run before any op, which is why it lives here, at collection time.
"""
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

LOGICAL_CPUS = 4
_cpu = tf.config.list_physical_devices("CPU")[0]
if len(tf.config.get_logical_device_configuration(_cpu) or []) < LOGICAL_CPUS:
    tf.config.set_logical_device_configuration(_cpu, [tf.config.LogicalDeviceConfiguration()] * LOGICAL_CPUS)


@pytest.fixture
def keras_float64():
    """floatx and the global dtype policy float64 (Keras fixes the policy from floatx at its first use), put back after."""
    import keras

    floatx, policy = keras.config.floatx(), keras.config.dtype_policy()
    keras.config.set_floatx("float64")
    keras.config.set_dtype_policy("float64")
    yield
    keras.config.set_floatx(floatx)
    keras.config.set_dtype_policy(policy)
