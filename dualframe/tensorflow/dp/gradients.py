"""Gradient averaging across ranks, written once for DistributedGradientTape and the Keras optimizer."""
from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import tensorflow as tf

from dualframe.dp.settings import ReduceSettings as CoreReduceSettings
from dualframe.errors import StrategyError
from dualframe.dp.checks import check_bool, check_compression, check_data_parallel, op_name
from dualframe.dp.checks import check_groups as core_check_groups
from dualframe.tensorflow.collectives import OPS, check_initialized, hvd
from dualframe.tensorflow.dp.compression import Compression

Gradient = Union[tf.Tensor, tf.IndexedSlices]
#: None, a number of buckets, or buckets of variable ids (``check_groups``).
Groups = Union[None, int, Tuple[Tuple[int, ...], ...]]

#: Absolute name scopes of the traced collectives. Horovod pairs the ranks' requests by name and,
#: given none, names a traced op after its scope and its first input: for a gradient, its layer's
#: name, which Keras numbers per process. A rank that built one more layer first (even one it threw
#: away) then asks for other names than its peers and the job hangs (plain) or aborts (the Gloo abort
#: of issue 17, sharded). Under these scopes the inputs are named by position instead.
PLAIN_SCOPE = "dualframe_dp/"
SHARD_SCOPE = "dualframe_shard/"


def collective_scope(scope: str) -> Any:
    """The fixed name scope ``scope`` for traced collectives (eager ones Horovod names alike on every rank)."""
    return contextlib.nullcontext() if tf.executing_eagerly() else tf.name_scope(scope)


def named(tensors: Sequence[Any], role: str) -> List[Any]:
    """``tensors`` renamed ``<role><i>`` (free identities; IndexedSlices part by part): the same names on every rank."""
    if tf.executing_eagerly():
        return list(tensors)
    out: List[Any] = []
    for i, t in enumerate(tensors):
        if isinstance(t, tf.IndexedSlices):
            out.append(tf.IndexedSlices(tf.identity(t.values, name=f"{role}{i}_values"),
                                        tf.identity(t.indices, name=f"{role}{i}_indices"), t.dense_shape))
        else:
            out.append(tf.identity(t, name=f"{role}{i}"))
    return out


@dataclass(frozen=True)
class ReduceSettings(CoreReduceSettings):
    """The core's reduction settings plus Horovod-TensorFlow's devices: validated once, before any communication.

    Example:
        >>> settings = ReduceSettings.build(compression="fp16", op=hvd.Average)  # doctest: +SKIP
        >>> reduce_gradients(grads, settings)                                     # doctest: +SKIP
    """

    device_dense: str = ""
    device_sparse: str = ""
    groups: Groups = None

    @classmethod
    def build(cls, what: str, compression: object = "none", op: object = "average", sparse_as_dense: object = False,
              gradient_predivide_factor: object = 1.0, process_set: object = None, backward_passes_per_step: object = 1,
              device_dense: str = "", device_sparse: str = "", groups: object = None,
              num_groups: object = 0) -> "ReduceSettings":
        """Check every argument (and that Horovod runs) and return the settings.

        ``groups`` (Horovod's): an int n (the gradients go in n allreduce calls) or lists of variables
        reduced together (the others together after them); ``num_groups`` is its old int spelling.

        Raises:
            NotInitializedError: ``init()`` was not called.
            StrategyError: an unknown op or compression, or a number out of range.
        """
        check_initialized(what)
        name = op_name(op, OPS)
        compressor = check_compression(compression, Compression)
        check_data_parallel(name, "none", backward_passes_per_step, gradient_predivide_factor)
        check_bool("sparse_as_dense", sparse_as_dense)
        process_set = hvd.global_process_set if process_set is None else process_set
        if not isinstance(process_set, hvd.ProcessSet) or process_set.process_set_id is None:
            raise StrategyError(f"process_set must be a registered hvd.ProcessSet (process_set: {process_set!r}); "
                                f"declare it with hvd.init(process_sets=[...])")
        return cls(compression=compressor, op=name, sparse_as_dense=bool(sparse_as_dense),
                   gradient_predivide_factor=float(gradient_predivide_factor),  # type: ignore[arg-type]
                   process_set=process_set, backward_passes_per_step=int(backward_passes_per_step),  # type: ignore
                   device_dense=device_dense, device_sparse=device_sparse, groups=check_groups(groups, num_groups))

    @property
    def horovod_op(self) -> Any:
        """Horovod's constant for ``op``."""
        return OPS[self.op]


def check_groups(groups: object, num_groups: object = 0) -> Groups:
    """Horovod's ``groups`` (the core's rule, members any variable), as buckets of variable ids.

    Raises:
        StrategyError: not None, an int >= 1 or lists of variables; or a variable listed twice.
    """
    if num_groups:
        warnings.warn("num_groups is deprecated; use groups", DeprecationWarning, stacklevel=3)
        groups = num_groups if groups is None else groups
    checked = core_check_groups(groups, "variable")
    if checked is None or isinstance(checked, int):
        return checked
    return tuple(tuple(id(v) for v in group) for group in checked)


def _buckets(indices: List[int], groups: Groups, variables: Optional[Sequence[Any]]) -> List[List[int]]:
    """``indices`` cut as ``groups`` says: one bucket, n near-equal ones, or the listed variables' then the rest."""
    if groups is None or not indices:
        return [indices]
    if isinstance(groups, int):
        n = min(groups, len(indices))
        return [indices[k * len(indices) // n:(k + 1) * len(indices) // n] for k in range(n)]
    if variables is None:
        return [indices]
    where = {key: g for g, group in enumerate(groups) for key in group}
    buckets: List[List[int]] = [[] for _ in range(len(groups) + 1)]
    for i in indices:
        buckets[where.get(id(variables[i]), len(groups))].append(i)
    return [b for b in buckets if b]


def reduce_gradients(grads: Sequence[Optional[Gradient]], settings: ReduceSettings,
                     variables: Optional[Sequence[Any]] = None) -> List[Optional[Gradient]]:
    """Reduce every gradient across the ranks of ``settings.process_set``; ``None`` stays ``None``.

    Dense gradients of one dtype go in one grouped allreduce (Horovod fuses them), or in the
    ``settings.groups`` buckets (``variables``, the gradients' variables, place listed groups);
    sparse ones (``tf.IndexedSlices``) are allgathered unless ``sparse_as_dense``. With one
    process nothing is sent.
    """
    out: List[Optional[Gradient]] = list(grads)
    if settings.process_set.size() == 1:
        return out
    with collective_scope(PLAIN_SCOPE):
        return _reduce(out, settings, variables)


def _reduce(out: List[Optional[Gradient]], settings: ReduceSettings,
            variables: Optional[Sequence[Any]]) -> List[Optional[Gradient]]:
    present = [i for i, grad in enumerate(out) if grad is not None]
    for i, grad in zip(present, named([out[i] for i in present], "grad")):
        out[i] = grad
    by_dtype: Dict[tf.DType, List[int]] = {}
    for i, grad in enumerate(out):
        if grad is None:
            continue
        if isinstance(grad, tf.IndexedSlices):
            if not settings.sparse_as_dense:
                out[i] = hvd.allreduce(grad, op=settings.horovod_op, process_set=settings.process_set,
                                       device_sparse=settings.device_sparse)
                continue
            grad = out[i] = tf.convert_to_tensor(grad)
        by_dtype.setdefault(grad.dtype, []).append(i)
    prescale, postscale = settings.scale_factors()
    for indices in [b for same in by_dtype.values() for b in _buckets(same, settings.groups, variables)]:
        reduced = hvd.grouped_allreduce(
            [out[i] for i in indices], op=settings.horovod_op, compression=settings.compression,
            prescale_factor=prescale, postscale_factor=postscale, process_set=settings.process_set,
            device_dense=settings.device_dense,
        )
        for i, value in zip(indices, reduced):
            out[i] = value
    return out
