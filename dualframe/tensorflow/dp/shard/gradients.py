"""The gradients of a Keras sharded optimizer: reduced into each rank's slice, and clipped by the norm over all slices.

Per bucket the gradients are flattened, concatenated, zero-padded and reduce-scattered (one grouped
Horovod reducescatter), or allreduced whole with each rank keeping its slice (``scatter=``). A mixin of
``dualframe.tensorflow.dp.shard.optimizer.ShardedOptimizer``, which builds the slices and owns the state
read here (torch's twin: ``dualframe.torch.dp.shard.gradients``).
"""
from __future__ import annotations

from typing import Any, List, Optional, Sequence

import tensorflow as tf
from keras import ops

from dualframe.tensorflow.collectives import hvd
from dualframe.tensorflow.dp.gradients import SHARD_SCOPE, collective_scope, named
from dualframe.tensorflow.dp.shard.slices import ShardedState

# How the gradients reach their owners (``scatter=``, the core's SCATTERS): one Horovod reduce-scatter
# of the flat buckets, or an allreduce of the gradients of which each rank keeps its slice (1.5x the
# bytes of reduce-scatter plus allgather). "auto" is the allreduce under both controllers, as in torch:
# Horovod 0.28's Gloo reducescatter costs about twice its allreduce (16.8M floats, np=2: 205 vs 115 ms),
# and under MPI, on the quiet box, ZeRO-2 stepped 1.24x plain with the reduce-scatter against 0.99x
# with the allreduce (scripts/bench_shard_tf.py, docs/benchmarks.md). On a real network, where bytes
# cost more than Horovod's per-call overhead, try scatter="reducescatter".
AUTO_SCATTER = "allreduce"


def scatter_path(scatter: str) -> str:
    """The path ``scatter`` means ("auto": ``AUTO_SCATTER``, the allreduce under both controllers)."""
    return AUTO_SCATTER if scatter == "auto" else scatter


class SliceGradients:
    """Reduces gradients into this rank's slices; sums a scalar over the ranks; clips by the global norm.

    Example:
        >>> class ShardedOptimizer(SliceGradients, keras.optimizers.Optimizer): ...   # doctest: +SKIP
    """

    # Set by ShardedOptimizer.__init__.
    reduction: Any
    scatter: str
    global_clipnorm_value: Optional[float]
    _zero: ShardedState

    def _reduce_scatter(self, grads: List[Any], buckets: Optional[Sequence[int]] = None,
                        role: str = "") -> List[tf.Tensor]:
        """This rank's reduced slice of each bucket (all, or ``buckets``) of ``grads`` (indexed like the variables)."""
        settings, zero = self.reduction, self._zero
        prescale, postscale = settings.scale_factors()
        if settings.process_set.size() > 1 and scatter_path(self.scatter) != "allreduce":
            with collective_scope(SHARD_SCOPE):
                return list(hvd.grouped_reducescatter(
                    named(zero.flatten(grads, buckets), f"{role}bucket"), op=settings.horovod_op,
                    compression=settings.compression, process_set=settings.process_set, prescale_factor=prescale,
                    postscale_factor=postscale, device_dense=settings.device_dense))
        members = zero.members(buckets)
        dense = zero.dense(grads, members)
        if settings.process_set.size() > 1:
            with collective_scope(SHARD_SCOPE):
                reduced = hvd.grouped_allreduce(
                    named([dense[t] for t in members], f"{role}grad"), op=settings.horovod_op,
                    compression=settings.compression, process_set=settings.process_set, prescale_factor=prescale,
                    postscale_factor=postscale, device_dense=settings.device_dense)
            for t, value in zip(members, reduced):
                dense[t] = value
        return zero.own_slices(dense, buckets)

    def sum_everywhere(self, value: Any, name: str) -> Any:
        """A scalar summed over the process set's ranks (one small allreduce; the same result on every rank)."""
        if self.reduction.process_set.size() == 1:
            return value
        with collective_scope(SHARD_SCOPE):
            return hvd.allreduce(named([value], name)[0], op=hvd.Sum, process_set=self.reduction.process_set)

    def _clip(self, slice_grads: List[tf.Tensor]) -> List[tf.Tensor]:
        """Keras's ``clip_by_global_norm`` with the norm over every rank's slice (padding adds zeros)."""
        clip = self.global_clipnorm_value
        if not clip or clip <= 0:
            return slice_grads
        squared = self.sum_everywhere(ops.sum(ops.stack([ops.sum(ops.square(g)) for g in slice_grads])),
                                      "squared_norm")
        norm = ops.sqrt(squared)
        scale = clip * ops.minimum(1.0 / norm, 1.0 / clip) + (norm - norm)  # NaN for a non-finite norm, as Keras
        return [g * ops.cast(scale, g.dtype) for g in slice_grads]
