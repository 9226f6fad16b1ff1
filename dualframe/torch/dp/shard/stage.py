"""ZeRO-3 among a pipeline stage's replicas: the stage gathered once per step, its gradients reduced once per step.

A process pipeline's stage runs ``chunks`` micro-batches per step, their forwards and backwards
interleaved by the schedule. Gathering a block before each micro-batch's forward and backward, as
``ParameterShardedOptimizer`` does for a plain model, would move the stage's parameters ``2 x chunks``
times per step. Here (as FSDP's ``reshard_after_forward=False`` inside a step): at the step's start
every block's allgather is started at once on the stage's replica set, and each block's first
forward waits for its own only; the parameters then stay gathered through every micro-batch. The
gradients accumulate in ``.grad`` over the micro-batches; as soon as a bucket's last micro-batch has
added its gradients, the bucket is reduced once into the owners' slices and, its block's buckets
all sent, the block is freed. Between steps a rank holds 1/R of the stage's parameters, gradients
and optimizer state (R: the stage's replicas); within a step it holds the stage's full parameters
and gradients (as ZeRO-2 would), its optimizer state still 1/R.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterable, Iterator, Tuple

import torch

from dualframe.dp.zero3 import ZERO3
from dualframe.errors import StrategyError
from dualframe.torch.dp.shard.blocks import BlockRun
from dualframe.torch.dp.shard.buckets import Slot
from dualframe.torch.dp.shard.gradients import SliceGradients
from dualframe.torch.dp.shard.parameters import ParameterShardedOptimizer


class StageShardedOptimizer(ParameterShardedOptimizer):
    """A pipeline stage's optimizer with ``shard="parameters"``: 1/R of the stage's parameters between steps.

    Built by ``DistributedPipeline.distributed_optimizer(opt, shard="parameters")``: ``model`` is the
    stage, ``process_set`` its replicas, ``backward_passes_per_step`` the step's micro-batches (times
    the user's). The pipeline calls ``begin_step`` before each walk and ``end_forward`` after an
    inference walk; its ``state_dict()`` / ``load_state_dict()`` go through ``gathered()`` and
    ``load_model_state_dict``, in the unsharded layout.

    Example:
        >>> pipe = hvd.DistributedPipeline(model, [3, 2], chunks=4, loss_fn=loss_fn, data_parallel=2)  # doctest: +SKIP
        >>> opt = pipe.distributed_optimizer(torch.optim.Adam(pipe.parameters()), shard="parameters")   # doctest: +SKIP
        >>> opt.zero_grad(); pipe.train_step(x, y); opt.step()                                        # doctest: +SKIP
        >>> full = pipe.state_dict()   # every replica of the stage calls it (an allgather)           # doctest: +SKIP

    Raises:
        StrategyError: as ``ParameterShardedOptimizer``; ``keep_gathered`` (the stage stays gathered for the step).
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> "StageShardedOptimizer":
        return object.__new__(cls)  # DistributedOptimizer.__new__ picks a class; this one is chosen already

    def __init__(self, optimizer: torch.optim.Optimizer, named_parameters: Iterable[Tuple[str, torch.Tensor]], *,
                 model: torch.nn.Module, process_set: Any, backward_passes_per_step: int, **kwargs: Any) -> None:
        if "keep_gathered" in kwargs:
            raise StrategyError("keep_gathered= has no use in a pipeline stage: with shard='parameters' its "
                                "parameters stay gathered from the step's first forward to its last backward")
        super().__init__(optimizer, named_parameters, shard=ZERO3, model=model, keep_gathered=0,
                         process_set=process_set, backward_passes_per_step=backward_passes_per_step, **kwargs)
        gather = self._gather
        assert gather is not None
        gather.remove()  # no gather and free around every micro-batch: only a wait for the step's gather
        gather.handles = [block.module.register_forward_pre_hook(self._waiter(block)) for block in self._blocks]

    def __repr__(self) -> str:
        return f"DistributedOptimizer(shard='parameters', stage, op={self.op_name}, {self._optimizer!r})"

    def _waiter(self, block: BlockRun) -> Any:
        def hook(module: torch.nn.Module, args: Any) -> None:
            assert self._gather is not None
            self._gather.wait(block)  # started by begin_step (or now, if the walk did not start it)
        return hook

    def begin_step(self, wait: bool = False) -> None:
        """Start allgathering every block of the stage (a block still gathered is left as it is).

        Args:
            wait: wait for them all now, not at each block's first forward: for a stage whose code may read
                a block's parameters without calling its module (a captured graph's ``get_attr``).
        """
        assert self._gather is not None
        for block in self._blocks:
            self._gather.start(block)
        if wait:
            self._gather.gathered_all()

    def end_forward(self) -> None:
        """After an inference walk: free every block (no backward will reduce and free them)."""
        assert self._gather is not None
        self._gather.free_all()

    def _on_gradient(self, p: torch.Tensor) -> None:
        SliceGradients._on_gradient(self, p)  # accumulated in .grad until the step's last micro-batch

    def _bucket_ready(self, slot: Slot) -> None:
        self._send(slot)  # reduced once, and its block freed once all the block's buckets are sent

    def synchronize(self) -> None:
        """Reduce what is left (parameters whose gradients no hook saw), wait for every slice, free every block."""
        super().synchronize()
        for p in self._delay:
            self._delay[p] = self.backward_passes_per_step

    def _pending(self) -> bool:
        passes = self.backward_passes_per_step
        return super()._pending() or any(delay != passes for delay in self._delay.values())

    @contextlib.contextmanager
    def gathered(self) -> Iterator[None]:
        """Every block gathered and the stage's ``state_dict()`` allowed inside (a collective on the replica set)."""
        assert self._gather is not None
        self._gather.gathered_all()
        try:
            with self._allowed():
                yield
        finally:
            self._gather.free_all()

    def listing(self) -> Any:
        """The stage's ``state_dict()`` allowed inside, for its keys (its parameters hold no values between steps)."""
        return self._allowed()

    def held_bytes(self) -> int:
        """Bytes this rank holds for the stage's weights: parameters' storage, slices and their gradients, state."""
        tensors = [s.flat for s in self._slots] + [s.flat.grad for s in self._slots if s.flat.grad is not None]
        tensors += [v for state in self._inner.state.values() for v in state.values()
                    if isinstance(v, torch.Tensor) and v.dim() > 0]
        present = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in self._model.parameters()}
        return sum(t.numel() * t.element_size() for t in tensors) + sum(present.values())

