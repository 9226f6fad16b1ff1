"""Horovod's TensorFlow collectives on Keras 3: reduce, gather, broadcast tensors, variables and objects."""
from __future__ import annotations

from typing import Any, List, Optional, Sequence

import tensorflow as tf

from dualframe.dp.checks import check_compression, check_root_rank, op_name
from dualframe.tensorflow.collectives import OPS, check_initialized, hvd
from dualframe.tensorflow.reliability.failure import eager_guard
from dualframe.tensorflow.dp.compression import Compression


def _process_set(process_set: Any) -> Any:
    return hvd.global_process_set if process_set is None else process_set


def allreduce(tensor: Any, average: Optional[bool] = None, device_dense: str = "", device_sparse: str = "",
              compression: Any = Compression.none, op: Any = None, prescale_factor: float = 1.0,
              postscale_factor: float = 1.0, name: Optional[str] = None, process_set: Any = hvd.global_process_set,
              ignore_name_scope: bool = False) -> Any:
    """Reduce ``tensor`` (a tensor, variable, NumPy array or ``tf.IndexedSlices``) over all ranks.

    ``op`` is a Horovod constant (``hvd.Average`` ...) or its name; the default is the average.
    ``ignore_name_scope``: Horovod's, the op's name leaves out the enclosing ``tf.name_scope``.

    Raises:
        NotInitializedError: before ``init()``.
        StrategyError: an unknown op or compression (checked before anything is sent).
    """
    check_initialized("allreduce")
    if average is not None:
        op = "average" if average else "sum"
    constant = OPS[op_name("average" if op is None else op, OPS)]
    compressor = check_compression(compression, Compression)
    if not isinstance(tensor, tf.IndexedSlices):
        tensor = tf.convert_to_tensor(tensor)
    with eager_guard(f"allreduce {name or ''}".strip()):
        return hvd.allreduce(tensor, device_dense=device_dense, device_sparse=device_sparse, compression=compressor,
                             op=constant, prescale_factor=prescale_factor, postscale_factor=postscale_factor,
                             name=name, process_set=_process_set(process_set),
                             ignore_name_scope=ignore_name_scope)


def allgather(tensor: Any, name: Optional[str] = None, ignore_name_scope: bool = False,
              process_set: Any = hvd.global_process_set) -> tf.Tensor:
    """Concatenate every rank's ``tensor`` along the first axis (the other axes must match)."""
    check_initialized("allgather")
    with eager_guard(f"allgather {name or ''}".strip()):
        return hvd.allgather(tf.convert_to_tensor(tensor), name=name, ignore_name_scope=ignore_name_scope,
                             process_set=_process_set(process_set))


def broadcast(tensor: Any, root_rank: int, name: Optional[str] = None, ignore_name_scope: bool = False,
              process_set: Any = hvd.global_process_set) -> tf.Tensor:
    """``root_rank``'s ``tensor``, on every rank."""
    check_initialized("broadcast")
    check_root_rank(root_rank, hvd.size())
    with eager_guard(f"broadcast {name or ''}".strip()):
        return hvd.broadcast(tf.convert_to_tensor(tensor), root_rank, name=name, ignore_name_scope=ignore_name_scope,
                             process_set=_process_set(process_set))


@tf.function(reduce_retracing=True)
def _broadcast_all(tensors: List[tf.Tensor], root_rank: int, process_set: Any) -> List[tf.Tensor]:
    # In one graph Horovod sees every broadcast at once and fuses them into few messages.
    return [hvd.broadcast(t, root_rank, name=f"dualframe.broadcast_variables.{i}", process_set=process_set)
            for i, t in enumerate(tensors)]


def broadcast_variables(variables: Sequence[Any], root_rank: int, process_set: Any = hvd.global_process_set,
                        inplace: bool = False) -> Any:
    """Assign ``root_rank``'s values to ``variables`` (Keras 3 or ``tf.Variable``) on every rank.

    Every rank must pass the same variables in the same order (``model.variables``,
    ``optimizer.variables``). Eagerly the values are assigned (``inplace``, Horovod's choice between
    an in-place broadcast and assigning, changes nothing then) and None is returned; in TF 1 graph
    mode this is Horovod's own ``broadcast_variables``, which returns the op to run.

    Raises:
        NotInitializedError: before ``init()``.
        StrategyError: ``root_rank`` outside ``[0, size)``.
    """
    check_initialized("broadcast_variables")
    check_root_rank(root_rank, hvd.size())
    if not tf.executing_eagerly():
        return hvd.broadcast_variables(variables, root_rank, process_set=_process_set(process_set), inplace=inplace)
    variables = list(variables)
    if not variables or hvd.size() == 1:
        return None
    with eager_guard("broadcast_variables"):
        values = _broadcast_all([tf.convert_to_tensor(v) for v in variables], root_rank, _process_set(process_set))
    for variable, value in zip(variables, values):
        variable.assign(value)
    return None


def broadcast_object(obj: Any, root_rank: int = 0, session: Any = None, name: Optional[str] = None,
                     process_set: Any = hvd.global_process_set) -> Any:
    """``root_rank``'s ``obj`` (anything cloudpickle can serialize), on every rank.

    ``session``: Horovod's, the TF 1 session that runs the broadcast in graph mode.
    """
    check_initialized("broadcast_object")
    check_root_rank(root_rank, hvd.size())
    with eager_guard("broadcast_object"):
        return hvd.broadcast_object(obj, root_rank, session=session, name=name, process_set=_process_set(process_set))


def allgather_object(obj: Any, session: Any = None, name: Optional[str] = None,
                     process_set: Any = hvd.global_process_set) -> List[Any]:
    """Every rank's ``obj``, as a list in rank order (``session``: as in ``broadcast_object``)."""
    check_initialized("allgather_object")
    with eager_guard("allgather_object"):
        return list(hvd.allgather_object(obj, session=session, name=name, process_set=_process_set(process_set)))


def local_rank() -> int:
    """This process's rank on its node."""
    check_initialized("local_rank()")
    return int(hvd.local_rank())


def local_size() -> int:
    """Number of processes on this node."""
    check_initialized("local_size()")
    return int(hvd.local_size())


def cross_rank() -> int:
    """This node's index."""
    check_initialized("cross_rank()")
    return int(hvd.cross_rank())


def cross_size() -> int:
    """Number of nodes."""
    check_initialized("cross_size()")
    return int(hvd.cross_size())


def barrier(process_set: Any = None) -> None:
    """Wait until every rank gets here (horovod.tensorflow 0.28 has no barrier: a one-number allreduce)."""
    check_initialized("barrier")
    with eager_guard("barrier"):
        hvd.allreduce(tf.zeros([1]), op=hvd.Sum, name="dualframe.barrier", process_set=_process_set(process_set))
