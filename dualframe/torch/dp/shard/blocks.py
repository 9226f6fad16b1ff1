"""ZeRO-3's blocks at run time for torch: a block's full parameters gathered before its forward and backward, freed after, the next one prefetched.

Each block's parameters are views of flat buffers (one per bucket of the block's layout, see
``dualframe.dp.zero3``). Freeing a block resizes those buffers' storage to zero bytes, so the views
autograd saved in forward (``weight.t()`` in a linear layer) hold no memory either; gathering
resizes them back and copies the allgathered slices in, and the saved views read the same values
again in backward. The order of blocks, and so which one to prefetch, is the core's ``GatherOrder``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator, List, Optional, Tuple

import torch

from dualframe.dp.zero3 import GatherOrder
from dualframe.torch.collectives import hvd
from dualframe.torch.dp.shard.buckets import Slot, travelling


@dataclass(eq=False)
class BlockRun:
    """One block at run time: its module, its slots (one per bucket), whether its full parameters are present."""

    index: int
    path: str
    module: torch.nn.Module
    slots: List[Slot]
    gathered: bool = True  # adopt() leaves the full parameters in place until the first free
    pending: List[Tuple[Slot, Any]] = field(default_factory=list)  # allgathers in flight
    sent: int = 0  # slots whose gradients were sent in this backward pass
    backward_done: bool = False


def tensors_in(value: Any) -> Iterator[torch.Tensor]:
    """Every tensor in a module's output (a tensor, or lists, tuples and dicts of them, as Hugging Face outputs)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from tensors_in(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from tensors_in(item)


def allgather_into(tensor: torch.Tensor, output: torch.Tensor, name: str, process_set: Any) -> Any:
    """Start allgathering ``tensor`` into ``output`` (already of the gathered size: Horovod writes it in place).

    Horovod 0.28's ``allgather_async`` gives its private ``_allgather_async`` a new empty output; given
    the block's buffer instead, the gathered slices land in the parameters' storage with no copy and
    no temporary of the block's size (Horovod resizes the output to the size it already has).
    """
    return hvd.mpi_ops._allgather_async(tensor, output, name, process_set)


class BlockGather:
    """Gathers, frees and prefetches the blocks of one sharded model (module hooks and output-gradient hooks).

    Example:
        >>> gather = BlockGather(blocks, process_set)   # built by the ZeRO-3 optimizer    # doctest: +SKIP
        >>> gather.free_all()                           # only the slices remain             # doctest: +SKIP
    """

    def __init__(self, blocks: List[BlockRun], process_set: Any, keep_gathered: int = 1) -> None:
        self.blocks = blocks
        self.process_set = process_set
        self.keep_gathered = keep_gathered  # the last blocks of the forward stay gathered until their backward
        self.order = GatherOrder()
        self.handles = []
        for block in blocks:
            self.handles.append(block.module.register_forward_pre_hook(self._pre_forward))
            self.handles.append(block.module.register_forward_hook(self._post_forward))
        self._of_module = {id(block.module): block for block in blocks}

    def start(self, block: BlockRun) -> None:
        """Start allgathering ``block``'s slices (nothing when present or already in flight)."""
        if block.gathered or block.pending:
            return
        for slot in block.slots:
            slot.buffer.untyped_storage().resize_(slot.buffer.numel() * slot.buffer.element_size())
            # fp32 master slices travel cast down to the model's dtype (bfloat16 as int16 bits: Horovod lacks it).
            sent = travelling(slot.flat, slot.precision)
            output = slot.buffer if sent.dtype == slot.buffer.dtype else slot.buffer.view(sent.dtype)
            block.pending.append((slot, allgather_into(sent, output, f"dualframe.gather.{slot.name}",
                                                       self.process_set)))

    def wait(self, block: BlockRun) -> None:
        """Make ``block``'s full parameters present (start the allgather if needed, and wait for it)."""
        self.start(block)
        for slot, handle in block.pending:
            hvd.synchronize(handle)
            slot.check_views()
        block.pending = []
        block.gathered = True

    def free(self, block: BlockRun) -> None:
        """Drop ``block``'s full parameters (their buffers keep no bytes); its slices remain."""
        if block.pending:
            self.wait(block)  # Horovod holds the allgather until it is synchronized
        for slot in block.slots:
            slot.buffer.untyped_storage().resize_(0)
        block.gathered = False

    def free_all(self) -> None:
        """Free every block (after a step, or before the first forward)."""
        for block in self.blocks:
            if block.gathered or block.pending:
                self.free(block)

    def gathered_all(self) -> "BlockGather":
        """Gather every block now (for a state dict); ``free_all`` ends it."""
        for block in self.blocks:
            self.start(block)
        for block in self.blocks:
            self.wait(block)
        return self

    # -- hooks --------------------------------------------------------------------------------------
    def _pre_forward(self, module: torch.nn.Module, args: Any) -> None:
        block = self._of_module[id(module)]
        self.order.seen(block.index)
        block.backward_done, block.sent = False, 0
        self.wait(block)
        ahead = self.order.next_forward(block.index)
        if ahead is not None:
            self.start(self.blocks[ahead])

    def _post_forward(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        block = self._of_module[id(module)]
        backward = False
        if torch.is_grad_enabled():
            for tensor in tensors_in(output):
                if tensor.requires_grad:
                    tensor.register_hook(self._before_backward(block))
                    backward = True
        if not (backward and self.order.kept(block.index, self.keep_gathered)):
            self.free(block)

    def _before_backward(self, block: BlockRun) -> Any:
        def hook(grad: torch.Tensor) -> Optional[torch.Tensor]:
            if not block.backward_done:
                self.wait(block)
                ahead = self.order.next_backward(block.index)
                if ahead is not None and not self.blocks[ahead].backward_done:
                    self.start(self.blocks[ahead])
            return None
        return hook

    def remove(self) -> None:
        """Remove the module hooks."""
        for handle in self.handles:
            handle.remove()
        self.handles = []
