"""The gradients of a torch sharded optimizer: each bucket reduced as soon as it is ready, this rank's slice kept.

Per bucket, as soon as backward has produced every gradient in it, the flat gradient goes through
one asynchronous Horovod collective (``gradient_path``: an in-place allreduce or a reduce-scatter),
overlapping the rest of backward, and the rank keeps its slice of the result as the ``.grad`` of its
flat slice. ``clip_grad_norm_`` clips those slices by the global norm. A mixin of
``dualframe.torch.dp.shard.optimizer.ShardedOptimizer``, which builds the slots and owns the state read here.
"""
from __future__ import annotations

from typing import Any, Dict, List, Tuple

import torch

from dualframe.errors import StrategyError
from dualframe.torch.collectives import OPS, hvd
from dualframe.torch.dp.shard.buckets import Slot, check_norm_arguments, clip_slices_

#: Buckets whose flat gradients are being reduced at once (beyond: wait for the oldest).
REDUCE_WINDOW = 4


class SliceGradients:
    """Reduces each ready bucket into this rank's slice; ``synchronize`` and ``clip_grad_norm_`` on the slices.

    Example:
        >>> class ShardedOptimizer(SliceGradients, DistributedOptimizer): ...   # doctest: +SKIP
    """

    # Built by ShardedOptimizer.__init__ and _build.
    _slots: List[Slot]
    _slot_of: Dict[torch.Tensor, Slot]
    _delay: Dict[torch.Tensor, int]
    _spare: Dict[Tuple[int, torch.dtype, torch.device], List[torch.Tensor]]
    _versions: Dict[torch.Tensor, Tuple[torch.Tensor, int]]
    _names: Dict[Any, str]
    _sent: int
    _synchronized: bool
    _clipped: bool
    _compression: Any
    settings: Any
    shard: Any
    gradient_path: str
    op: Any
    process_set: Any
    backward_passes_per_step: int

    def _on_gradient(self, p: torch.Tensor) -> None:
        slot = self._slot_of.get(p)
        if slot is None:
            return
        if slot.pending is not None:
            raise AssertionError(
                f"gradients were computed more than backward_passes_per_step ({self.backward_passes_per_step}) "
                f"times before step(); raise backward_passes_per_step (parameter {self._names.get(p)})")
        self._delay[p] -= 1
        if self._delay[p] > 0:
            return
        slot.ready += 1
        if slot.ready == len(slot.members):
            self._bucket_ready(slot)

    def _bucket_ready(self, slot: Slot) -> None:
        """Every gradient of ``slot`` is accumulated for this step: reduce it (a pipeline's ZeRO-3 also frees)."""
        self._reduce_bucket(slot)

    def _reduce_bucket(self, slot: Slot) -> None:
        bucket = slot.bucket
        first = slot.members[0]
        # Summed in the parameters' dtype, or in the master's where Horovod cannot sum it (bfloat16).
        dtype = first.dtype if slot.precision is None else getattr(torch, slot.precision.reduce)
        key = (bucket.padded, dtype, first.device)
        spare = self._spare.get(key)
        flat = spare.pop() if spare else torch.empty(bucket.padded, dtype=dtype, device=first.device)
        flat[bucket.length:].zero_()  # every other element is written below
        for p, offset, size in zip(slot.members, bucket.offsets, bucket.sizes):
            if p.grad is None:  # another rank may have a gradient for it: this rank sends zeros
                flat[offset:offset + size].zero_()
            else:
                grad = p.grad.to_dense() if p.grad.is_sparse else p.grad
                flat[offset:offset + size].copy_(grad.reshape(-1))
            if self.shard != "optimizer":
                p.grad = None  # ZeRO-2 and 3: the full gradient is not kept, only the reduced slice
        self._sent += 1
        slot.order = self._sent
        compressed, ctx = self._compression.compress(flat)
        prescale, postscale = self.settings.scale_factors()
        name = f"dualframe.shard.grad.{slot.name}"
        if self.gradient_path == "allreduce":
            handle = hvd.allreduce_async_(compressed, name=name, op=self.op, process_set=self.process_set,
                                          prescale_factor=prescale, postscale_factor=postscale)
        else:
            handle = hvd.reducescatter_async(compressed, name=name, op=self.op, process_set=self.process_set,
                                             prescale_factor=prescale, postscale_factor=postscale)
        slot.pending = (handle, ctx, flat)
        slot.done = False
        # Horovod holds a sent buffer until it is synchronized: collect finished buckets now, and wait
        # for the oldest beyond REDUCE_WINDOW, so that the flat copies never add up to the full gradients.
        sent = [other for other in self._slots if other.pending is not None and not other.done]
        sent.sort(key=lambda other: other.order)
        for k, other in enumerate(sent):
            if k < len(sent) - REDUCE_WINDOW or hvd.poll(other.pending[0]):  # type: ignore[index]
                self._finish_bucket(other)

    def _finish_bucket(self, slot: Slot) -> None:
        assert slot.pending is not None
        handle, ctx, flat = slot.pending
        reduced = hvd.synchronize(handle)
        if self.gradient_path == "allreduce":
            reduced = reduced[slot.start:slot.start + slot.bucket.shard]
        reduced = self._compression.decompress(reduced, ctx)
        grad = reduced if reduced.dtype == slot.flat.dtype else reduced.to(slot.flat.dtype)
        if grad.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr():
            grad = grad.clone()  # the send buffer is reused by the next step
        if self.shard == "parameters" and slot.flat.grad is not None:
            slot.flat.grad.add_(grad)  # ZeRO-3 reduces every backward pass: the passes' slices add up
        else:
            slot.flat.grad = grad
        self._spare.setdefault((flat.numel(), flat.dtype, flat.device), []).append(flat)
        slot.done = True

    def synchronize(self) -> None:
        """Wait for every bucket's reduce-scatter (starting those not started); slices' gradients are then set."""
        for slot in self._slots:
            if slot.pending is None:
                self._reduce_bucket(slot)
        for slot in self._slots:
            if not slot.done:
                self._finish_bucket(slot)
            slot.pending, slot.ready, slot.done = None, 0, False
            for p in slot.members:
                self._delay[p] = self.backward_passes_per_step
        # ZeRO-1 keeps each rank's own, unreduced .grad: step() refuses it changed after this (see _check_untouched).
        self._versions = {p: (p.grad, p.grad._version) for p in self._slot_of if p.grad is not None}
        self._synchronized = True

    def _pending(self) -> bool:
        # Between backward and step: a bucket sent or partly ready, or gradients accumulating locally.
        passes = self.backward_passes_per_step
        return any(slot.pending is not None or slot.ready for slot in self._slots) or any(
            delay != passes for delay in self._delay.values())

    def _check_untouched(self) -> None:
        # Horovod's recipe (synchronize(); clip .grad; skip_synchronize() step) changes .grad, which a
        # sharded step never reads: it reads the reduced slices. Refused rather than silently unclipped.
        changed = [self._names.get(p, "?") for p, (grad, version) in self._versions.items()
                   if p.grad is not grad or (grad is not None and grad._version != version)]
        if changed:
            raise StrategyError(
                f"the parameters' .grad changed between synchronize() and step() ({', '.join(changed[:3])}"
                f"{' ...' if len(changed) > 3 else ''}); with shard={self.shard!r} step() uses the reduced gradient "
                f"slices, not .grad, so that change would be lost. To clip, call optimizer.clip_grad_norm_(max_norm) "
                f"after backward instead of synchronize() + torch.nn.utils.clip_grad_norm_")

    def reduced_slices(self) -> List[torch.Tensor]:
        """This rank's slices of the reduced gradients (synchronizing first); ``step()`` then takes them as they are.

        ``hvd.ShardedGradScaler`` unscales these in place and checks them for infs and NaNs.
        """
        if not self._synchronized:
            self.synchronize()
        self._clipped = True  # as after clip_grad_norm_: step() must not reduce again
        return [slot.flat.grad for slot in self._slots if slot.flat.grad is not None]

    def sum_everywhere(self, value: torch.Tensor, name: str) -> torch.Tensor:
        """``value`` (a scalar) summed over the ranks of the process set: one small allreduce, the same on every rank."""
        total = hvd.allreduce(value.detach().reshape(1).to(torch.float32), name=f"dualframe.shard.{name}",
                              op=OPS["sum"], process_set=self.process_set)
        return total.reshape(()).to(value.device)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the reduced gradients by their global norm, as ``torch.nn.utils.clip_grad_norm_`` on plain DP.

        Call it after backward and before ``step()`` (on every rank: it synchronizes the gradients,
        then allreduces one number, each rank's sum of |g|^p over its slices); ``step()`` then uses
        the clipped slices without reducing again.

        Args:
            max_norm: the largest global norm of the gradients.
            norm_type: p of the p-norm (``float("inf")``: the largest absolute value).

        Returns:
            The global norm of the reduced gradients before clipping (a float32 scalar tensor).

        Raises:
            StrategyError: ``max_norm`` or ``norm_type`` not a number > 0 (before any communication).

        Example:
            >>> loss.backward()                                                   # doctest: +SKIP
            >>> total = optimizer.clip_grad_norm_(1.0)   # not torch.nn.utils's   # doctest: +SKIP
            >>> optimizer.step()                                                  # doctest: +SKIP
        """
        check_norm_arguments(max_norm, norm_type)
        if not self._synchronized:
            self.synchronize()
        total = clip_slices_([slot.flat.grad for slot in self._slots if slot.flat.grad is not None], max_norm,
                             norm_type, lambda local, op: hvd.allreduce(local, name="dualframe.shard.clip_norm",
                                                                        op=OPS[op], process_set=self.process_set))
        self._clipped = True
        return total
