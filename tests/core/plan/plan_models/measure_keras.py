"""Measure the peak memory of real Keras training steps on the CPU, in this fresh process.

    python measure_keras.py MODULE:FUNCTION BATCH INPUT_SHAPE WARM_FUNCTION

The model (a keras_hub backbone: dict inputs ``token_ids``, ``padding_mask``) trains two steps with
Adam on the mean of its output, the loss ``dualframe plan``'s Keras probe traces. Prints one JSON
line: {"peak": bytes}: the resident-set high-water mark (VmHWM) during the steps minus the resident
set just before the model is built, after a warm-up step on a small model of the same kind
(WARM_FUNCTION, in the same module) has loaded keras_hub's modules and TF's kernels. Run with ``MALLOC_MMAP_THRESHOLD_=65536`` so freed buffers
leave the resident set.
"""
import gc
import importlib
import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from tests.core.plan.plan_models.resident import status  # noqa: E402


def _trainer(model):
    optimizer = keras.optimizers.Adam(1e-3)

    @tf.function
    def step(batch):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(model(batch, training=True))
        optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
        return loss

    return step


def main() -> None:
    spec, batch_size, shape = sys.argv[1:4]
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    shape = tuple(int(d) for d in shape.split("x"))
    module_name, function = spec.split(":")
    builder = getattr(importlib.import_module(module_name), function)
    ids = np.random.randint(0, 100, (int(batch_size), *shape)).astype("int32")
    batch = {"token_ids": ids, "padding_mask": np.ones_like(ids)}
    # A small model of the same kind trained one step loads keras_hub's modules and TF's kernels.
    warm = getattr(importlib.import_module(module_name), sys.argv[4])()
    _trainer(warm)(batch)
    del warm
    keras.backend.clear_session()
    gc.collect()
    baseline = status("VmRSS")
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")
    model = builder()
    step = _trainer(model)
    for _ in range(2):
        step(batch)
    print(json.dumps({"peak": status("VmHWM") - baseline, "baseline": baseline}))


if __name__ == "__main__":
    main()
