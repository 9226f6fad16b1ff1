"""DistributedGradientTape: a tf.GradientTape whose gradients come back averaged over all ranks."""
from __future__ import annotations

from typing import Any, Dict, Iterable, List, Optional, Tuple

import keras
import tensorflow as tf

from dualframe.dp.subclass import wrapper_subclass
from dualframe.errors import StrategyError
from dualframe.tensorflow.collectives import hvd
from dualframe.tensorflow.reliability.failure import eager_guard
from dualframe.tensorflow.dp.compression import Compression
from dualframe.tensorflow.dp.gradients import ReduceSettings, reduce_gradients


class DistributedGradientTape(tf.GradientTape):
    """Wraps a ``tf.GradientTape``: ``gradient()`` returns gradients reduced across ranks.

    An instance of ``tf.GradientTape`` and of the wrapped tape's own class, as Horovod's (a class
    deriving from both, made once per tape class by ``dualframe.dp.subclass``). Recording, watching
    and the local ``jacobian``/``batch_jacobian`` go to the wrapped tape; its sources are kept by
    identity, so it works with Keras 3 variables (Horovod's keys them by ``Variable.ref()``, which
    Keras 3 variables lack). Gradients of sources registered with ``register_local_source`` stay local
    (divided by the size when ``scale_local_gradients``, as Horovod).

    Example:
        >>> with tf.GradientTape() as tape:                                  # doctest: +SKIP
        ...     loss = loss_fn(y, model(x, training=True))
        >>> tape = hvd.DistributedGradientTape(tape, compression=hvd.Compression.fp16)  # doctest: +SKIP
        >>> grads = tape.gradient(loss, model.trainable_variables)           # doctest: +SKIP
        >>> optimizer.apply_gradients(zip(grads, model.trainable_variables))  # doctest: +SKIP
    """

    def __new__(cls, gradtape: Any = None, *args: Any, **kwargs: Any) -> "DistributedGradientTape":
        if cls is DistributedGradientTape and isinstance(gradtape, tf.GradientTape) \
                and not isinstance(gradtape, DistributedGradientTape):
            cls = wrapper_subclass(DistributedGradientTape, type(gradtape))[0]
        return super().__new__(cls)

    def __init__(self, gradtape: tf.GradientTape, device_dense: str = "", device_sparse: str = "",
                 compression: Any = Compression.none, sparse_as_dense: bool = False, op: Any = hvd.Average,
                 gradient_predivide_factor: float = 1.0, num_groups: int = 0, groups: Any = None,
                 process_set: Any = hvd.global_process_set, scale_local_gradients: bool = True) -> None:
        if isinstance(gradtape, DistributedGradientTape):
            raise StrategyError("this tape is already a DistributedGradientTape; wrap a tf.GradientTape only once")
        if not isinstance(gradtape, tf.GradientTape):
            raise TypeError(f"DistributedGradientTape wraps a tf.GradientTape (got {type(gradtape).__name__})")
        self._settings = ReduceSettings.build(
            "DistributedGradientTape", compression, op, sparse_as_dense, gradient_predivide_factor, process_set,
            device_dense=device_dense, device_sparse=device_sparse, groups=groups, num_groups=num_groups)
        # tf.GradientTape's own fields, for code that reads them; this object records nothing itself.
        tf.GradientTape.__init__(self, persistent=gradtape._persistent,
                                 watch_accessed_variables=gradtape._watch_accessed_variables)
        self._wrapped = gradtape
        self.scale_local_gradients = bool(scale_local_gradients)
        self._local_sources: Dict[int, Any] = {}

    def __enter__(self) -> "DistributedGradientTape":
        self._wrapped.__enter__()
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self._wrapped.__exit__(*exc_info)

    def watch(self, tensor: Any) -> None:
        """Watch ``tensor`` (as ``tf.GradientTape.watch``)."""
        self._wrapped.watch(tensor)

    def watched_variables(self) -> Tuple[Any, ...]:
        """The variables the tape watched."""
        return tuple(self._wrapped.watched_variables())

    def stop_recording(self) -> Any:
        """Context manager that pauses recording (as ``tf.GradientTape.stop_recording``)."""
        return self._wrapped.stop_recording()

    def reset(self) -> None:
        """Clear what the tape recorded."""
        self._wrapped.reset()

    def jacobian(self, *args: Any, **kwargs: Any) -> Any:
        """The wrapped tape's ``jacobian``: local, not reduced (as Horovod's)."""
        return self._wrapped.jacobian(*args, **kwargs)

    def batch_jacobian(self, *args: Any, **kwargs: Any) -> Any:
        """The wrapped tape's ``batch_jacobian``: local, not reduced (as Horovod's)."""
        return self._wrapped.batch_jacobian(*args, **kwargs)

    def register_local_source(self, source: Any) -> None:
        """Keep ``source``'s gradient local: it is not reduced across ranks."""
        self._local_sources[id(source)] = source

    def gradient(self, target: Any, sources: Any, output_gradients: Any = None, use_generic_names: bool = False, *,
                 unconnected_gradients: Any = tf.UnconnectedGradients.NONE) -> Any:
        """Gradients of ``target`` w.r.t. ``sources`` (any nest), reduced across ranks.

        ``use_generic_names`` (Horovod's: name the reductions by position, not by variable) changes
        nothing here: traced reductions are always named by position (``gradients.named``).
        """
        flat = tf.nest.flatten(sources)
        grads = list(self._wrapped.gradient(target, flat, output_gradients, unconnected_gradients))
        shared = [i for i, s in enumerate(flat) if id(s) not in self._local_sources]
        with eager_guard("DistributedGradientTape.gradient"):
            reduced = reduce_gradients([grads[i] for i in shared], self._settings, [flat[i] for i in shared])
        for i, value in zip(shared, reduced):
            grads[i] = value
        if self.scale_local_gradients and len(shared) < len(flat):
            size = float(self._settings.process_set.size())
            for i in sorted(set(range(len(flat))) - set(shared)):
                grads[i] = _divide(grads[i], size)
        return tf.nest.pack_sequence_as(sources, grads)

    def get_local_and_global_gradients(self, target: Any, sources: Iterable[Any], output_gradients: Any = None
                                       ) -> Tuple[List[Tuple[Any, Any]], List[Tuple[Any, Any]]]:
        """(source, gradient) pairs split into (local, global) lists."""
        sources = list(sources)
        grads = self.gradient(target, sources, output_gradients)
        local = [(s, g) for s, g in zip(sources, grads) if id(s) in self._local_sources]
        shared = [(s, g) for s, g in zip(sources, grads) if id(s) not in self._local_sources]
        return local, shared


def _divide(grad: Optional[Any], size: float) -> Optional[Any]:
    if grad is None:
        return None
    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(grad.values / size, grad.indices, grad.dense_shape)
    return grad / size


def PartialDistributedGradientTape(gradtape: tf.GradientTape, device_dense: str = "", device_sparse: str = "",
                                   compression: Any = Compression.none, sparse_as_dense: bool = False,
                                   op: Any = hvd.Average, gradient_predivide_factor: float = 1.0,
                                   num_groups: int = 0, groups: Any = None,
                                   process_set: Any = hvd.global_process_set, local_layers: Any = None,
                                   scale_local_gradients: bool = True) -> DistributedGradientTape:
    """A DistributedGradientTape that keeps the gradients of ``local_layers`` (Keras layers) local."""
    if local_layers is None:
        local_layers = []
    elif isinstance(local_layers, keras.layers.Layer):
        local_layers = [local_layers]
    layers = list(local_layers)
    for j, layer in enumerate(layers):
        if not isinstance(layer, keras.layers.Layer):
            raise TypeError(f"local_layers must be Keras layers (local_layers[{j}]: {type(layer).__name__})")
    tape = DistributedGradientTape(gradtape, device_dense, device_sparse, compression, sparse_as_dense, op,
                                   gradient_predivide_factor, num_groups, groups, process_set, scale_local_gradients)
    for layer in layers:
        for variable in layer.trainable_weights:
            tape.register_local_source(variable)
    return tape
