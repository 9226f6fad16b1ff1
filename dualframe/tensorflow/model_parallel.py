"""``ModelParallel`` for Keras 3: a list of layers split into groups whose variables live on explicit TF devices."""
from __future__ import annotations

import re
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import keras
import tensorflow as tf

from dualframe.errors import ChunksError, DeviceError
from dualframe.pipeline.microbatch import micro_batch_sizes
from dualframe.pipeline.executor import RecordFn, run_ticks
from dualframe.pipeline.schedule import one_process_ticks
from dualframe.pipeline.split import SplitPlan, plan_split
from dualframe.observe.timeline import Recording

_NAME = re.compile(r"^/?(?:.*device:)?(cpu|gpu|tpu)(?::(\d+))?$", re.IGNORECASE)
HINT = ("; more CPU devices for testing: dualframe.tensorflow.logical_cpus(n) before TensorFlow runs any op")


def canonical_device(name: str) -> str:
    """TensorFlow's short spelling of a device (``"cpu"`` / ``"/device:CPU:0"`` -> ``"/CPU:0"``).

    Raises:
        DeviceError: not a CPU, GPU or TPU device name.
    """
    match = _NAME.match(name.strip()) if isinstance(name, str) else None
    if not match:
        raise DeviceError(f"unknown device {name!r}; use '/CPU:<index>' or '/GPU:<index>'")
    return f"/{match.group(1).upper()}:{match.group(2) or 0}"


def available_devices() -> List[str]:
    """The logical devices TensorFlow can place on here, CPUs first (``"/CPU:0"``, ``"/GPU:1"``)."""
    names = [canonical_device(d.name) for d in tf.config.list_logical_devices()]
    return sorted(set(names), key=lambda n: (not n.startswith("/CPU"), n))


def logical_cpus(count: int) -> List[str]:
    """Split the host CPU into ``count`` logical devices ``/CPU:0`` ... (to try a split without GPUs).

    Must run before TensorFlow initializes its devices (before the first op); does nothing when at
    least ``count`` CPU devices already exist.

    Raises:
        DeviceError: TensorFlow already initialized with fewer CPU devices.
    """
    cpu = tf.config.list_physical_devices("CPU")[0]
    current = tf.config.get_logical_device_configuration(cpu) or []
    if len(current) >= count:
        return [f"/CPU:{k}" for k in range(count)]
    try:
        tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * count)
    except RuntimeError as error:
        raise DeviceError(
            f"cannot make {count} logical CPU devices: TensorFlow is already initialized ({error}); "
            f"call dualframe.tensorflow.logical_cpus({count}) at the top of the script"
        ) from None
    return [f"/CPU:{k}" for k in range(count)]


class ModelParallel(Recording, keras.Model):
    """The Keras model running the strategy ``dualframe.ModelParallel``: layers in groups, group j's on ``devices[j]``.

    A ``keras.Model``: works with ``compile``/``fit`` and ``tf.GradientTape``; ``get_weights()`` is in
    layer order. Each layer takes and returns one tensor.

    Example:
        >>> import dualframe.tensorflow as hvd
        >>> model = hvd.ModelParallel([keras.layers.Dense(32, "relu"), keras.layers.Dense(4)],
        ...                           balance=[1, 1], devices=["/GPU:0", "/GPU:1"])   # doctest: +SKIP
        >>> model.compile(optimizer="adam", loss="mse"); model.fit(x, y)             # doctest: +SKIP

    Args:
        layers: the layers, in order.
        balance: layers per group.
        devices: one device per group; None: the visible GPUs (the local rank's share under a
            launcher), else ``"/CPU:0"`` repeated.

    Raises:
        BalanceError, DeviceError: before any variable is made, naming the values.
    """

    def __init__(self, layers: Sequence[keras.layers.Layer], balance: Sequence[int],
                 devices: Optional[Sequence[str]] = None, *, chunks: int = 1, checkpoint: str = "never",
                 schedule: str = "gpipe", **kwargs: Any) -> None:
        layers = list(layers)
        for index, layer in enumerate(layers):
            if not isinstance(layer, keras.layers.Layer):
                raise TypeError(f"every layer must be a keras Layer (layers[{index}]: {type(layer).__name__})")
        available = available_devices()
        plan = plan_split(len(layers), balance, devices, chunks, checkpoint, available=available,
                          canonical=canonical_device, accelerators=[d for d in available if "/GPU" in d], hint=HINT,
                          schedule=schedule)
        super().__init__(**kwargs)
        self.plan: SplitPlan = plan
        self.split_layers = layers
        self._cells: Dict[Tuple[int, bool], Callable[..., tf.Tensor]] = {}

    @property
    def balance(self) -> List[int]:
        """Layers per group."""
        return self.plan.balance

    @property
    def devices(self) -> Tuple[str, ...]:
        """One device per group."""
        return self.plan.devices

    def build(self, input_shape: Any) -> None:
        """Create each layer's variables under ``tf.device`` of its group."""
        shape = tuple(input_shape)
        for r, device in zip(self.plan.ranges, self.plan.devices):
            with tf.device(device):
                for index in r:
                    layer = self.split_layers[index]
                    if not layer.built:
                        layer.build(shape)
                    shape = tuple(layer.compute_output_spec(keras.KerasTensor(shape)).shape)
        self.built = True

    def _stage(self, j: int, training: Any) -> Callable[[tf.Tensor], tf.Tensor]:
        def run(x: tf.Tensor) -> tf.Tensor:
            for index in self.plan.ranges[j]:
                x = self.split_layers[index](x, training=training)
            return x
        return run

    def call(self, inputs: tf.Tensor, training: Any = None) -> tf.Tensor:
        """Run the micro-batches through the groups in the clock-tick order of the core's schedule."""
        parts = self._split(inputs)
        m, n = len(parts), self.plan.stages
        outputs: Dict[Tuple[int, int], tf.Tensor] = {}
        record = self.recorder(self.plan.devices) if tf.executing_eagerly() else None

        def cell(i: int, j: int) -> None:
            source = parts[i] if j == 0 else outputs[(i, j - 1)]
            fn = self._stage(j, training)
            if self.plan.checkpointed(i) and training:
                fn = tf.recompute_grad(fn)
            if record is not None:
                fn = _timed_backward(fn, i, j, record)
            with tf.device(self.plan.devices[j]):
                outputs[(i, j)] = fn(source)

        run_ticks(one_process_ticks(self.plan.schedule, m, n, "F"), cell, n, "F", parallel=False, record=record)
        with tf.device(self.plan.devices[-1]):
            return outputs[(0, n - 1)] if m == 1 else tf.concat([outputs[(i, n - 1)] for i in range(m)], axis=0)

    def _split(self, inputs: tf.Tensor) -> List[tf.Tensor]:
        m = self.plan.chunks
        if m == 1:
            return [inputs]
        batch = inputs.shape[0]
        if batch is not None:
            return list(tf.split(inputs, micro_batch_sizes(int(batch), m), axis=0))
        # Unknown batch while tracing (e.g. fit's last, smaller batch): sizes as graph values.
        rows = tf.shape(inputs)[0]
        tf.debugging.assert_greater_equal(rows, m, message=str(ChunksError(
            f"the batch is smaller than chunks (chunks: {m}); use chunks <= batch or a larger batch")))
        base, extra = rows // m, rows % m
        sizes = tf.stack([base + tf.cast(i < extra, rows.dtype) for i in range(m)])
        return list(tf.split(inputs, sizes, num=m, axis=0))

    def compute_output_shape(self, input_shape: Any) -> Any:
        shape = tuple(input_shape)
        for layer in self.split_layers:
            shape = tuple(layer.compute_output_spec(keras.KerasTensor(shape)).shape)
        return shape


def _timed_backward(fn: Callable[[tf.Tensor], tf.Tensor], i: int, j: int, record: RecordFn) -> Callable[[tf.Tensor], tf.Tensor]:
    """``fn`` whose gradient, when eager, is timed as the backward cell (i, j) of the timeline."""

    @tf.custom_gradient
    def timed(x: tf.Tensor) -> Any:
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = fn(x)

        def grad(dy: tf.Tensor, variables: Optional[List[tf.Variable]] = None) -> Any:
            start = time.perf_counter()
            grads = tape.gradient(y, [x] + list(variables or []), output_gradients=dy)
            record("B", i, j, start, time.perf_counter())
            return grads[0], grads[1:]

        return y, grad

    return timed
