"""``ModelParallel`` for Keras 3: a functional model, a Sequential or a list of layers in stages on TF devices."""
from __future__ import annotations

import re
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import keras
import tensorflow as tf

from dualframe.errors import ChunksError, DeviceError
from dualframe.pipeline.microbatch import micro_batch_sizes
from dualframe.pipeline.executor import run_ticks
from dualframe.pipeline.schedule import one_process_ticks
from dualframe.pipeline.split import Split, validate_split
from dualframe.observe.timeline import Recording
from dualframe.pipeline.graph import GraphSplit, graph_units
from dualframe.tensorflow.graph.capture import KerasGraph, capture, layers_called, layers_called_first, place_variables
from dualframe.tensorflow.graph.cut import describe_split, split_model
from dualframe.tensorflow.split.backward import recomputed, timed_backward

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


def stage_devices(devices: Optional[Any] = None, count: int = 2) -> Optional[List[str]]:
    """The devices for a split, the same script on a GPU node and on a laptop.

    ``devices`` (a list or a comma-separated string such as a ``--devices`` option) is kept, with the
    logical CPU devices it names made first (``/CPU:1`` exists only then). Without it: None when
    GPUs are visible (``ModelParallel`` then takes them, the local rank's share under a launcher),
    else ``count`` logical CPUs. Like ``logical_cpus``, call it before TensorFlow runs any op.

    Args:
        devices: the devices asked for, or None.
        count: how many stages, when no devices are given and no GPU is visible.

    Raises:
        DeviceError: a name that is not a device, or TensorFlow initialized with fewer CPU devices.

    Example:
        >>> import dualframe.tensorflow as hvd                                    # doctest: +SKIP
        >>> hvd.stage_devices("/CPU:0,/CPU:1")                                     # doctest: +SKIP
        ['/CPU:0', '/CPU:1']
    """
    if devices:
        names = [canonical_device(d) for d in (devices.split(",") if isinstance(devices, str) else devices)]
        cpus = [int(name.rsplit(":", 1)[1]) for name in names if name.startswith("/CPU")]
        if cpus:
            logical_cpus(max(cpus) + 1)
        return names
    if tf.config.list_physical_devices("GPU"):
        return None
    return logical_cpus(count)


class ModelParallel(Recording, keras.Model):
    """The Keras model running the strategy ``dualframe.ModelParallel``: a model in stages, stage j's on ``devices[j]``.

    Takes a functional ``keras.Model`` (several inputs and outputs, skip connections, shared layers),
    a ``keras.Sequential`` or a list of layers each taking and returning one tensor. The layers are the
    model's own (not copies): ``weights``/``get_weights()`` keep the model's order and names, so weights
    load both ways. Each tensor goes to each stage that reads it, on that stage's device, and nowhere
    else. A ``keras.Model``: works with ``compile``/``fit`` and ``tf.GradientTape``.

    Example:
        >>> import dualframe.tensorflow as hvd
        >>> model = keras.applications.ResNet50(weights=None, input_shape=(32, 32, 3), classes=10)
        >>> split = hvd.ModelParallel(model, split_points=["conv4_block1_1_conv"],
        ...                           devices=["/GPU:0", "/GPU:1"])                   # doctest: +SKIP
        >>> print(split.describe()); split.compile(optimizer="adam", loss="mse")      # doctest: +SKIP

    Args:
        layers: a functional ``keras.Model``, a ``keras.Sequential`` or a list of layers.
        balance: layers per stage, counting ``graph_units`` in execution order (``len(model.layers)``
            when no layer is called twice: ``[90, 87]`` on ResNet50; a stack of repeated blocks such as
            a keras_hub backbone's transformer layers: blocks, ``[2, 2]`` on 4 layers, see ``block_units``).
        devices: one device per stage; None: the visible GPUs (the local rank's share under a
            launcher), else ``"/CPU:0"`` repeated.
        split_points: instead of ``balance``, the names of the layers where stages 1..n-1 begin.
        stages: instead of ``balance``, how many stages: cuts chosen to even the cost measured on
            ``sample`` (``by="time"``) or the bytes (``by="memory"``), then where least crosses.
        sample: a batch to measure on, for ``stages=``.
        by: ``"time"`` or ``"memory"``, for ``stages=``.

    Raises:
        BalanceError, SplitPointError, DeviceError, TraceError: before any variable is made or moved,
            naming the values.
    """

    def __init__(self, layers: Any, balance: Optional[Sequence[int]] = None,
                 devices: Optional[Sequence[str]] = None, *, chunks: int = 1, checkpoint: str = "never",
                 schedule: str = "gpipe", split_points: Optional[Sequence[str]] = None,
                 stages: Optional[int] = None, sample: Any = None, by: str = "time", **kwargs: Any) -> None:
        captured = capture(layers)
        split = split_model(captured, split_points=split_points, balance=balance, stages=stages, sample=sample, by=by,
                            measure=False)  # every argument checked, nothing run yet
        available = available_devices()
        plan = self._plan(captured, split, devices, chunks, checkpoint, schedule, available)
        if stages is not None and split.stages > 1:
            split = split_model(captured, stages=stages, sample=sample, by=by)  # measured
            plan = self._plan(captured, split, devices, chunks, checkpoint, schedule, available)
        super().__init__(**kwargs)
        self.plan: Split = plan
        self.graph_split: GraphSplit = split
        self.captured: KerasGraph = captured
        # Tracked in model.layers order, as Functional tracks them: weights and get_weights() are the model's.
        self.split_layers = list(captured.layers)
        self._stage_layers = [self._layers_of(j) for j in range(plan.stages)]
        if all(layer.built for layer in captured.layers):  # a model, or layers built by measuring them
            self._place()
        self._cells: Dict[Tuple[int, bool], Callable[..., tf.Tensor]] = {}

    @staticmethod
    def _plan(captured: KerasGraph, split: GraphSplit, devices: Optional[Sequence[str]], chunks: int,
              checkpoint: str, schedule: str, available: List[str]) -> Split:
        units = graph_units(split.graph)
        bounds = list(split.starts) + [len(split.graph.nodes)]
        balance = [sum(1 for u in units if bounds[j] <= u.start < bounds[j + 1]) for j in range(split.stages)]
        return validate_split(len(units), balance, devices, chunks, checkpoint, available=available,
                              canonical=canonical_device, accelerators=[d for d in available if "/GPU" in d],
                              hint=HINT, schedule=schedule)

    def _layers_of(self, j: int) -> List[Any]:
        """The layers stage j calls first (a shared layer's variables go where it first runs)."""
        return layers_called_first(self.captured, self.graph_split, j)

    def _state_of(self, j: int) -> List[Any]:
        """What a recomputed stage j starts again from: Dropout's seed states, BatchNormalization's statistics.

        Not kept as an attribute: Keras would track the variables in it as the model's own, out of order.
        """
        return [v for layer in layers_called(self.captured, self.graph_split, j) for v in layer.non_trainable_variables]

    def _place(self) -> None:
        for layers, device in zip(self._stage_layers, self.plan.devices):
            place_variables(layers, device)

    @property
    def balance(self) -> List[int]:
        """Layers (graph units) per stage."""
        return self.plan.balance

    @property
    def devices(self) -> Tuple[str, ...]:
        """One device per stage."""
        return self.plan.devices

    @property
    def split_points(self) -> Tuple[str, ...]:
        """The names of the layers where stages 1..n-1 begin (what to pass as ``split_points=``)."""
        return self.graph_split.split_points

    def describe(self) -> str:
        """The stages, their devices and layers, and per boundary each tensor crossing it with its shape and size."""
        return describe_split(self.captured, self.graph_split, self.plan.devices)

    def build(self, input_shape: Any) -> None:
        """Create (a list of layers) or move (a built model) each layer's variables under ``tf.device`` of its stage."""
        if all(layer.built for layer in self.captured.layers):
            self._place()
            self.built = True
            return
        shape = tuple(input_shape)
        for r, device in zip(self.plan.ranges, self.plan.devices):
            with tf.device(device):
                for index in r:
                    layer = self.captured.layers[index]
                    if not layer.built:
                        layer.build(shape)
                    spec = layer.compute_output_spec(keras.KerasTensor(shape))
                    shape = tuple(spec.shape)
                    self.captured.specs[self.captured.graph.nodes[index].outputs[0]] = spec  # for describe()
        self.built = True

    def _stage(self, j: int, training: Any) -> Callable[..., Tuple[tf.Tensor, ...]]:
        reads, sends, nodes = self.graph_split.reads[j], self.graph_split.sends[j], self.graph_split.stage_range(j)

        def run(*tensors: tf.Tensor) -> Tuple[tf.Tensor, ...]:
            values = dict(zip(reads, tensors))
            self.captured.run(nodes, values, training)
            self.captured.check_masks_kept(nodes, values)
            return tuple(values[v] for v in sends)
        return run

    def call(self, inputs: Any, training: Any = None) -> Any:
        """Run the micro-batches through the stages in the clock-tick order of the core's schedule."""
        split = self.graph_split
        parts = self._split(self.captured.flat_inputs(inputs))
        m, n = len(parts), self.plan.stages
        values = [dict(zip(split.graph.inputs, part)) for part in parts]  # per micro-batch: value -> tensor
        record = self.recorder(self.plan.devices) if tf.executing_eagerly() else None

        def cell(i: int, j: int) -> None:
            fn = self._stage(j, training)
            if self.plan.checkpointed(i) and training:
                fn = recomputed(fn, self._state_of(j))
            if record is not None:
                fn = timed_backward(fn, i, j, record)
            with tf.device(self.plan.devices[j]):
                # Each value this stage reads is copied onto its device once, whichever stage made it.
                outputs = fn(*[tf.identity(values[i][v]) for v in split.reads[j]])
            values[i].update(zip(split.sends[j], outputs))

        run_ticks(one_process_ticks(self.plan.schedule, m, n, "F"), cell, n, "F", parallel=False, record=record)
        with tf.device(self.plan.devices[-1]):
            flat = [values[0][v] if m == 1 else tf.concat([values[i][v] for i in range(m)], axis=0)
                    for v in split.graph.outputs]
        return self.captured.pack_outputs(flat)

    def _split(self, inputs: List[tf.Tensor]) -> List[List[tf.Tensor]]:
        """Per micro-batch, its rows of every model input."""
        m = self.plan.chunks
        if m == 1:
            return [inputs]
        batch = inputs[0].shape[0]
        if batch is not None:
            sizes: Any = micro_batch_sizes(int(batch), m)
        else:
            # Unknown batch while tracing (e.g. fit's last, smaller batch): sizes as graph values.
            rows = tf.shape(inputs[0])[0]
            tf.debugging.assert_greater_equal(rows, m, message=str(ChunksError(
                f"the batch is smaller than chunks (chunks: {m}); use chunks <= batch or a larger batch")))
            base, extra = rows // m, rows % m
            sizes = tf.stack([base + tf.cast(i < extra, rows.dtype) for i in range(m)])
        pieces = [tf.split(x, sizes, num=m, axis=0) for x in inputs]
        return [[piece[i] for piece in pieces] for i in range(m)]

    def compute_output_shape(self, input_shape: Any) -> Any:
        if self.captured.model is not None:
            return self.captured.model.compute_output_shape(input_shape)
        shape = tuple(input_shape)
        for layer in self.captured.layers:
            shape = tuple(layer.compute_output_spec(keras.KerasTensor(shape)).shape)
        return shape

    def save_weights(self, filepath: str, overwrite: bool = True, **kwargs: Any) -> None:
        """Save as the model given would (a model's file loads into the unsplit model and back)."""
        if self.captured.model is None:
            return super().save_weights(filepath, overwrite=overwrite, **kwargs)
        return self.captured.model.save_weights(filepath, overwrite=overwrite, **kwargs)

    def load_weights(self, filepath: str, **kwargs: Any) -> None:
        """Load a file saved by the model given, or by this split of it."""
        if self.captured.model is None:
            return super().load_weights(filepath, **kwargs)
        return self.captured.model.load_weights(filepath, **kwargs)

