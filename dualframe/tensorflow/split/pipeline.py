"""``Pipeline`` for Keras 3: a split model run in one process, micro-batched (GPipe), checkpointing activations."""
from __future__ import annotations

from typing import Any, Optional, Sequence

from dualframe.tensorflow.split.model_parallel import ModelParallel


class Pipeline(ModelParallel):
    """The Keras model that runs a pipeline in one process (the strategy it runs is ``dualframe.Pipeline``):
    each mini-batch cut into ``chunks`` micro-batches that flow through the groups.

    The graph is built cell by cell in the core's clock-tick order, each cell under ``tf.device`` of its
    stage; inside ``fit`` (a ``tf.function``) TensorFlow's executor runs independent cells on different
    devices at the same time. Checkpointed micro-batches keep only their stage inputs and recompute
    activations in backward. An Embedding's gradient stays ``tf.IndexedSlices`` in every mode, as in
    ``fit`` on the unsplit model, so Adam updates only the rows read.

    Example:
        >>> import dualframe.tensorflow as hvd
        >>> layers = [keras.layers.Dense(64, "relu"), keras.layers.Dense(64, "relu"), keras.layers.Dense(10)]
        >>> pipe = hvd.Pipeline(layers, balance=[2, 1], devices=["/CPU:0", "/CPU:0"], chunks=4)
        >>> pipe.compile(optimizer="adam", loss="mse")
        >>> pipe.fit(x, y, batch_size=32)                          # doctest: +SKIP

    Args:
        layers: a functional ``keras.Model``, a ``keras.Sequential`` or a list of layers (each taking and
            returning one tensor).
        balance: layers per group; or, as keywords, ``split_points=``, ``stages=`` with ``sample=``/``by=``
            (see ``ModelParallel``).
        devices: one device per group; None: the visible GPUs, else ``"/CPU:0"`` repeated.
        chunks: micro-batches per mini-batch; a batch must have at least ``chunks`` rows.
        checkpoint: ``"except_last"`` (default), ``"always"`` or ``"never"``. Recomputation reruns a
            stage's layers from the state its forward started with (Dropout draws the forward's mask
            again, BatchNormalization's moving statistics move once), so each mode trains alike.
        schedule: a registered schedule one process can run (``"gpipe"``). ``"1f1b"`` and ``"zb-h1"`` are
            refused by name: they interleave backward with forward, which needs the loss inside the
            pipeline, and here Keras computes the loss after ``call`` returns; use ``DistributedPipeline``
            for them (zb-h1 there: torch today, Keras with its process pipeline's split backward).

    Raises:
        BalanceError, DeviceError, ChunksError, StrategyError, ScheduleError: before any variable is made.
    """

    def __init__(self, layers: Any, balance: Optional[Sequence[int]] = None,
                 devices: Optional[Sequence[str]] = None, chunks: int = 1, checkpoint: str = "except_last",
                 schedule: str = "gpipe", **kwargs: Any) -> None:
        super().__init__(layers, balance, devices, chunks=chunks, checkpoint=checkpoint, schedule=schedule, **kwargs)

    @property
    def chunks(self) -> int:
        """Micro-batches per mini-batch."""
        return self.plan.chunks

    @property
    def checkpoint(self) -> str:
        """The activation checkpointing mode."""
        return self.plan.checkpoint

    @property
    def schedule(self) -> str:
        """The schedule's registered name (``"gpipe"``)."""
        return self.plan.schedule
