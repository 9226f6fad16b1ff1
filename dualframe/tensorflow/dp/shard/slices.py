"""A sharded Keras optimizer's per-rank state: the flat slice variables, the inner optimizer, and its full-layout view.

Moves values between the model's variables and this rank's slices (pieces given by the core's
:class:`dualframe.dp.shard.ShardLayout`), and between the inner optimizer's slot slices and the
plain optimizer's layout (``variables`` of the same optimizer built on the model: its non-slot
variables, then each model variable's slots in order), which is what checkpoints hold.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import keras
import numpy as np
import tensorflow as tf

from dualframe.dp.precision import master_dtype
from dualframe.dp.shard import ShardLayout
from dualframe.errors import StrategyError

#: Name prefix of the slice variables; the inner optimizer names each slot ``<slice path>_<slot>``.
SLICE_NAME = "dualframe_shard_"

#: Optimizers whose update of an element reads only that element's gradient and state (and scalars).
ELEMENTWISE = ("SGD", "Adam", "AdamW", "Adamax", "Nadam", "RMSprop", "Adagrad", "Adadelta", "Ftrl", "Lion")


def check_elementwise(optimizer: keras.optimizers.Optimizer) -> None:
    """Refuse an optimizer whose update of one element reads other elements of its tensor (or other tensors).

    Rule: a slice of a flat buffer mixes tensors and splits them, so each element's update may read
    only that element's gradient and state and scalars (learning rate, step). Lamb (trust ratio of
    each tensor's norm), Adafactor (factored moments by shape), Muon (orthogonalises matrices),
    ``clipnorm`` (the norm of each tensor), ``use_ema`` (averages of whole model
    variables) and ``exclude_from_weight_decay`` (chosen per variable) break it. ``global_clipnorm`` is
    allowed: the sharded optimizer takes the norm over every rank's slice itself (see :func:`inner_copy`).
    """
    kind = type(optimizer).__name__
    base = next((c.__name__ for c in type(optimizer).__mro__ if c.__module__.startswith("keras")
                 and c.__name__ in ELEMENTWISE), None)
    if base is None:
        raise StrategyError(
            f"shard= needs an optimizer that updates each element from its own gradient and state "
            f"({', '.join(ELEMENTWISE)}); {kind} is not one of them (Lamb, Adafactor and Muon read norms or "
            f"shapes of whole tensors). Use shard=None for it")
    if getattr(optimizer, "clipnorm", None) is not None:
        raise StrategyError(f"shard= cannot use clipnorm={optimizer.clipnorm} (a norm of each whole tensor, which "
                            f"no rank holds); use global_clipnorm or clipvalue, or shard=None")
    if getattr(optimizer, "use_ema", False):
        raise StrategyError("shard= cannot use use_ema=True (it averages whole model variables); use shard=None")
    if getattr(optimizer, "_exclude_from_weight_decay", None) or \
            getattr(optimizer, "_exclude_from_weight_decay_pattern", None) is not None:
        raise StrategyError("shard= cannot use exclude_from_weight_decay (a slice mixes variables); decay all "
                            "variables, or use shard=None")


def inner_copy(optimizer: keras.optimizers.Optimizer) -> Tuple[keras.optimizers.Optimizer, Optional[float]]:
    """A copy of ``optimizer`` (same class and config) without ``global_clipnorm``, and that clip norm.

    The copy sees one rank's slices only, so it must not take the norm itself: the sharded optimizer
    clips with the norm over all ranks' slices before handing it the gradients.
    """
    config = optimizer.get_config()
    clip = config.get("global_clipnorm")
    config["global_clipnorm"] = None
    return type(optimizer).from_config(config), (None if clip is None else float(clip))


def check_master_dtypes(variables: Sequence[Any]) -> None:
    """Refuse float16 and bfloat16 trainable variables for ZeRO-1/2, which write the slices back into them.

    A slice written back into a float16 variable and read from it again next step would lose the fp32
    master's digits; ZeRO-3's slices are the only copy, so it keeps them in float32 (the torch adapter
    keeps fp32 master slices in every mode).
    """
    low = [v for v in variables if master_dtype(str(v.dtype)) != str(v.dtype)]
    if low:
        dtype = str(low[0].dtype)
        named = ", ".join(f"{v.path} ({v.dtype})" for v in low[:3]) + (f" and {len(low) - 3} more" if len(low) > 3 else "")
        raise StrategyError(
            f"shard='optimizer' and 'gradients' in Keras keep no fp32 master slices of float16 or bfloat16 "
            f"variables: {named}. Use shard='parameters' (fp32 master slices), or for {dtype} compute the "
            f"mixed_{dtype} policy (float32 variables: keras.mixed_precision.set_dtype_policy('mixed_{dtype}') "
            f"before building the model, or the layer's dtype='mixed_{dtype}'), or shard=None")


class ShardedState:
    """The inner optimizer, the slice variables and the layout: a plain holder the Keras tracker does not walk."""

    def __init__(self, inner: keras.optimizers.Optimizer) -> None:
        self.inner = inner
        self.layout: Optional[ShardLayout] = None
        self.rank = 0
        self.variables: List[Any] = []
        self.slices: List[Any] = []
        self.buffers: List[Any] = []
        self.counter: Any = None
        #: ZeRO-3: the model's full values until ``build`` cuts them (then []); None: read the model's variables.
        self.values: Optional[List[Any]] = None
        #: ZeRO-3: the model whose values the slices hold, and the values of its non-trainable variables
        #: (replicated, as in plain data parallelism: batch-norm statistics, counters).
        self.model: Any = None
        self.replicated: List[Any] = []
        #: ZeRO-3: the core's plan (``dualframe.dp.zero3``) as one layout, and each top-level layer's buckets in it.
        self.planned: Optional[ShardLayout] = None
        self.blocks: Dict[int, Tuple[int, ...]] = {}
        #: ZeRO-3: when each layer's gather may start (``sharded_layers.Ahead``: one layer ahead, traced).
        self.ahead: Any = None
        #: Whether every rank was seen to hold the same parameters (at the first apply after a build or sync).
        self.checked = False
        #: ``guard(slice_grads, step)``: how a loss-scaling wrapper steps (``shard_precision``); None: ``step`` directly.
        self.guard: Optional[Callable[[List[Any], Callable[[List[Any]], None]], None]] = None

    def build(self, layout: ShardLayout, variables: List[Any], rank: int,
              values: Optional[Sequence[Any]] = None) -> None:
        """One flat slice variable per bucket, holding this rank's part of the model; the inner optimizer's slots.

        ``values`` (one per variable) are read instead of the variables (ZeRO-3: the model holds none).
        """
        if self.model is None:  # ZeRO-1/2 write the slices back into the variables: no master then
            check_master_dtypes(variables)
        self.layout, self.variables, self.rank = layout, variables, rank
        self.slices = []
        for b, bucket in enumerate(layout.buckets):
            # ZeRO-3's slices are the only copy: fp32 masters of float16/bfloat16 variables.
            dtype = master_dtype(str(variables[bucket.tensors[0]].dtype)) if bucket.tensors else "float32"
            # ZeRO-3's slices are what a tape differentiates (through each layer's gather): trainable there.
            self.slices.append(keras.Variable(tf.zeros([bucket.shard], dtype=dtype), trainable=self.model is not None,
                                              name=f"{SLICE_NAME}{b}"))
        self.load_slices(values)
        self.inner.build(self.slices)

    def check_variables(self, grads: Sequence[Any], variables: Optional[Sequence[Any]]) -> None:
        if len(grads) != len(self.variables) or (
                variables is not None and any(a is not b for a, b in zip(variables, self.variables))):
            raise StrategyError(
                f"a sharded optimizer applies gradients to the variables it was built on, in that order "
                f"(built on {len(self.variables)}, given {len(grads)}); pass every trainable variable each step")

    def check_built_on(self, variables: Sequence[Any]) -> None:
        """Refuse building again on other variables than the model's (or, ZeRO-3, the slices) it was built on."""
        variables = list(variables)
        same = len(variables) == len(self.variables) and all(a is b for a, b in zip(variables, self.variables))
        if not same and not (self.model is not None and self.are_slices(variables)):
            raise StrategyError(
                f"this sharded optimizer is built on its model's {len(self.variables)} trainable variables and "
                f"cannot be built again on {len(variables)} others (a second state); make one optimizer per model")

    def are_slices(self, variables: Sequence[Any]) -> bool:
        """Whether ``variables`` are exactly this state's slice variables, in order."""
        variables = list(variables)
        return len(variables) == len(self.slices) and all(a is b for a, b in zip(variables, self.slices))

    # --- model <-> slices -------------------------------------------------------------------------------------
    def dense(self, grads: Sequence[Any], members: Optional[Sequence[int]] = None) -> List[Any]:
        """The gradients (of every variable, or of ``members``; others None) as dense tensors, a missing one as zeros."""
        chosen = set(range(len(self.variables)) if members is None else members)
        return [None if t not in chosen else tf.zeros(v.shape, v.dtype) if g is None else tf.convert_to_tensor(g)
                for t, (g, v) in enumerate(zip(grads, self.variables))]

    def members(self, buckets: Optional[Sequence[int]] = None) -> List[int]:
        """The variables in ``buckets`` (default: all), bucket by bucket."""
        assert self.layout is not None
        return [t for b in self._chosen(buckets) for t in self.layout.buckets[b].tensors]

    def flatten(self, grads: Sequence[Any], buckets: Optional[Sequence[int]] = None) -> List[tf.Tensor]:
        """Per bucket (all, or ``buckets``): the gradients flattened, concatenated and zero-padded.

        A missing gradient counts as zeros; ``grads`` is indexed like the model's variables.
        """
        assert self.layout is not None
        flats: List[tf.Tensor] = []
        for b in self._chosen(buckets):
            bucket = self.layout.buckets[b]
            parts = []
            for t in bucket.tensors:
                grad, variable = grads[t], self.variables[t]
                grad = tf.zeros(variable.shape, variable.dtype) if grad is None else tf.convert_to_tensor(grad)
                parts.append(tf.cast(tf.reshape(grad, [-1]), self.slices[b].dtype))
            flats.append(self._pad(parts, bucket.padded - bucket.length, self.slices[b].dtype))
        return flats

    def _chosen(self, buckets: Optional[Sequence[int]]) -> Sequence[int]:
        assert self.layout is not None
        return range(len(self.layout.buckets)) if buckets is None else buckets

    def own_slices(self, tensors: Sequence[Any], buckets: Optional[Sequence[int]] = None) -> List[tf.Tensor]:
        """Per bucket (all, or ``buckets``): this rank's slice of full-size ``tensors`` (one per model variable).

        Copies 1/N of the elements: what a reduce-scatter made of an allreduce keeps, and what
        :meth:`load_slices` reads from the model.
        """
        assert self.layout is not None
        out: List[tf.Tensor] = []
        for b in self._chosen(buckets):
            bucket, pieces = self.layout.buckets[b], self.layout.buckets[b].pieces(self.rank)
            parts = [tf.cast(tf.reshape(tensors[p.tensor], [-1])[p.start:p.start + p.length], self.slices[b].dtype)
                     for p in pieces]
            owned = sum(p.length for p in pieces)
            out.append(self._pad(parts, bucket.shard - owned, self.slices[b].dtype))
        return out

    def load_slices(self, values: Optional[Sequence[Any]] = None) -> None:
        """Copy this rank's slice of the model's current values (or of ``values``) into the slice variables."""
        for slice_variable, value in zip(self.slices, self.own_slices(self.variables if values is None else values)):
            slice_variable.assign(value)

    def unflatten(self, gathered: Sequence[Any], buckets: Optional[Sequence[int]] = None) -> List[Any]:
        """Allgathered flat buffers of every bucket (or of ``buckets``) cut back into one tensor per model variable.

        One split per bucket; the variables of other buckets get None.
        """
        assert self.layout is not None
        out: List[Any] = [None] * len(self.variables)
        for b, flat in zip(self._chosen(buckets), gathered):
            bucket = self.layout.buckets[b]
            sizes = list(bucket.sizes) + ([bucket.padded - bucket.length] if bucket.padded > bucket.length else [])
            for t, part in zip(bucket.tensors, tf.split(flat, sizes)):
                out[t] = tf.reshape(part, self.variables[t].shape)
        return out

    def write_back(self, gathered: Sequence[Any]) -> None:
        """Write every bucket's allgathered flat buffer into the model's variables."""
        for variable, value in zip(self.variables, self.unflatten(gathered)):
            variable.assign(value)

    @staticmethod
    def _pad(parts: List[Any], pad: int, dtype: Any) -> tf.Tensor:
        if pad:
            parts = parts + [tf.zeros([pad], dtype=dtype)]
        return tf.concat(parts, axis=0) if parts else tf.zeros([0], dtype=dtype)

    # --- the inner optimizer's variables, and the plain layout ---------------------------------------------------
    def _slots(self) -> List[Tuple[int, str, Any]]:
        """(bucket, slot name, variable) for each inner variable built from a slice."""
        out = []
        for variable in self.inner.variables:
            for b in range(len(self.slices)):
                mark = f"{SLICE_NAME}{b}_"
                if mark in variable.name:
                    out.append((b, variable.name.split(mark, 1)[1], variable))
                    break
        return out

    def slot_variables(self) -> List[Any]:
        return [variable for _, _, variable in self._slots()]

    def replicated_variables(self) -> List[Any]:
        slots = {id(v) for v in self.slot_variables()}
        return [v for v in self.inner.variables if id(v) not in slots]

    def slot_names(self) -> List[str]:
        return [name for b, name, _ in self._slots() if b == 0]

    def gather_state(self, process_set: Any) -> List[np.ndarray]:
        """The plain optimizer's ``variables`` values: non-slot ones, then each model variable's slots (collective).

        Each slot in its model variable's dtype, as a plain optimizer keeps it: a float16 variable's
        slots are the float32 master slots rounded to float16 (``scatter_state`` takes either).
        """
        from dualframe.tensorflow.collectives import hvd

        assert self.layout is not None
        slots = self._slots()
        values = [tf.convert_to_tensor(v) for _, _, v in slots]
        if process_set.size() > 1 and values:
            values = list(hvd.grouped_allgather(values, process_set=process_set))
        full = {(b, name): np.asarray(value) for (b, name, _), value in zip(slots, values)}
        arrays = [np.asarray(v) for v in self.replicated_variables()]
        names = self.slot_names()
        for t, variable in enumerate(self.variables):
            b, offset, size = self._where(t)
            for name in names:
                arrays.append(full[(b, name)][offset:offset + size].reshape(tuple(variable.shape))
                              .astype(str(variable.dtype), copy=False))
        return arrays

    def scatter_state(self, arrays: Sequence[np.ndarray]) -> None:
        """Assign this rank's slices of the plain optimizer's ``variables`` values (no communication).

        Slots of float16 or bfloat16 variables may come in their variable's dtype (a plain optimizer's,
        or :meth:`gather_state`'s) or in float32 (kept whole in the float32 master slots).
        """
        assert self.layout is not None
        replicated, names = self.replicated_variables(), self.slot_names()
        expected = len(replicated) + len(names) * len(self.variables)
        if len(arrays) != expected:
            raise StrategyError(
                f"optimizer state does not match this sharded {type(self.inner).__name__} (arrays: {len(arrays)}, "
                f"expected: {len(replicated)} non-slot + {len(names)} slots x {len(self.variables)} variables = "
                f"{expected}); save it from the same optimizer class and model")
        for variable, array in zip(replicated, arrays):
            variable.assign(array)
        first = len(replicated)
        by_key = {(b, name): v for b, name, v in self._slots()}
        for b, bucket in enumerate(self.layout.buckets):
            pieces = bucket.pieces(self.rank)
            for s, name in enumerate(names):
                parts = [np.asarray(arrays[first + p.tensor * len(names) + s]).reshape(-1)[p.start:p.start + p.length]
                         for p in pieces]
                target = by_key[(b, name)]
                flat = np.zeros(bucket.shard, dtype=np.dtype(str(target.dtype)))
                if parts:
                    joined = np.concatenate(parts)
                    flat[:len(joined)] = joined
                target.assign(flat)

    def _where(self, t: int) -> Tuple[int, int, int]:
        assert self.layout is not None
        for b, bucket in enumerate(self.layout.buckets):
            if t in bucket.tensors:
                i = bucket.tensors.index(t)
                return b, bucket.offsets[i], bucket.sizes[i]
        raise KeyError(t)
