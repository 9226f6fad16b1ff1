"""``Pipeline``: a split torch model run in one process with micro-batching (GPipe) and per-micro-batch checkpointing."""
from __future__ import annotations

from typing import Any, Iterable, List, Optional, Sequence, Union

from torch import nn

from dualframe.torch.split.deferred_batch_norm import DeferredBatchNorm
from dualframe.torch.graph.capture import Leaves
from dualframe.torch.split.model_parallel import ModelParallel, is_graph_split


class Pipeline(ModelParallel):
    """The module that runs a pipeline in one process (the strategy it runs is ``dualframe.Pipeline``):
    the mini-batch cut into ``chunks`` micro-batches that flow through the groups so that the devices
    work at the same time; outputs and gradients equal the unsplit module's.

    Each clock tick of the core's schedule runs its (micro-batch, stage) cells in threads, one per
    device; backward runs the mirrored schedule the same way. Cells that share a device run one after
    another in the calling thread (a device runs one thing at a time), so a Pipeline with every group
    on one device costs about what micro-batching costs the plain module. Batch sizes that ``chunks``
    does not divide are fine (micro-batches differ by at most one row).

    Example:
        >>> import dualframe.torch as hvd
        >>> model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
        >>> pipe = hvd.Pipeline(model, balance=[3, 2], devices=["cpu", "cpu"], chunks=4)
        >>> loss = pipe(torch.randn(10, 16)).pow(2).mean()
        >>> loss.backward()

    Args:
        module: an ``nn.Sequential`` (or a list of layers) split by ``balance``, or any ``nn.Module`` cut as a
            graph (``split_points``, ``balance`` in top-level units, or ``stages``: see ``ModelParallel``).
        balance: number of layers per group (a graph: top-level units per stage).
        devices: one device per group; None: the visible GPUs (the local rank's share under a
            launcher), else ``"cpu"`` repeated.
        chunks: micro-batches per mini-batch; the batch must have at least ``chunks`` rows.
        checkpoint: ``"except_last"`` (default; every micro-batch but the last keeps only its stage
            inputs and recomputes its activations in backward), ``"always"`` or ``"never"``.
        deferred_batch_norm: replace BatchNorm layers by ``DeferredBatchNorm``, whose running
            statistics are those of the whole mini-batch rather than of the last micro-batch.
        overlap_cpu: run the cells of a tick whose stages are all on ``"cpu"`` in threads too, one per
            cell, so that they overlap on a multi-core CPU when each op uses fewer threads than there
            are cores (how the schedule is shown on a CPU-only machine); costs thread hand-offs.
        schedule: a registered schedule one process can run (``"gpipe"``). ``"1f1b"`` and ``"zb-h1"`` are
            refused by name: they interleave backward with forward, which needs the loss inside the
            pipeline, and here the caller computes the loss after forward returns; use
            ``DistributedPipeline`` for them.
        split_points, stages, sample, by, leaves: cutting any model as a graph, as in ``ModelParallel``.

    Raises:
        BalanceError, DeviceError, ChunksError, StrategyError, ScheduleError: before any compute,
            naming the values.
        StageError: a stage failed; the message shows the schedule with the failing cell marked.
    """

    def __init__(self, module: Union[nn.Module, Iterable[nn.Module]], balance: Optional[Sequence[int]] = None,
                 devices: Optional[Sequence[str]] = None, chunks: int = 1, checkpoint: str = "except_last",
                 deferred_batch_norm: bool = False, overlap_cpu: bool = False, schedule: str = "gpipe", *,
                 split_points: Optional[Sequence[str]] = None, stages: Optional[int] = None, sample: Any = None,
                 by: str = "time", leaves: Leaves = ()) -> None:
        if not isinstance(overlap_cpu, bool):
            raise TypeError(f"overlap_cpu must be True or False (overlap_cpu: {overlap_cpu!r})")
        graph = is_graph_split(module, split_points, stages)
        if graph and deferred_batch_norm and isinstance(module, nn.Module):  # converted before capture, kept whole
            module, leaves = DeferredBatchNorm.convert(module), (*leaves, DeferredBatchNorm)
        super().__init__(module, balance, devices, chunks=chunks, checkpoint=checkpoint, schedule=schedule,
                         split_points=split_points, stages=stages, sample=sample, by=by, leaves=leaves)
        self.overlap_cpu = overlap_cpu
        if deferred_batch_norm and not graph:
            for partition in self.partitions:
                DeferredBatchNorm.convert(partition)
        self._deferred: List[DeferredBatchNorm] = [
            m for m in self.modules() if isinstance(m, DeferredBatchNorm)
        ]

    @property
    def checkpoint(self) -> str:
        """The activation checkpointing mode."""
        return self.plan.checkpoint

    @property
    def schedule(self) -> str:
        """The schedule's registered name (``"gpipe"``)."""
        return self.plan.schedule

    def _lanes(self) -> List[str]:
        if not self.overlap_cpu:
            return super()._lanes()
        return [f"cpu#{j}" if d == "cpu" else d for j, d in enumerate(self.plan.devices)]

    def _begin_step(self, batch: int) -> None:
        if self.training:
            for norm in self._deferred:
                norm.begin()

    def _end_forward(self) -> None:
        for norm in self._deferred:
            norm.commit()
