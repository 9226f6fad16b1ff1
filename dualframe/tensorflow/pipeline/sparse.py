"""A Keras stage's sparse gradients (``tf.IndexedSlices``, an Embedding's): a step's micro-batches summed by concatenation."""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

import tensorflow as tf


def added(a: Any, b: Any) -> Any:
    """``a + b`` of two gradients (None: none); two IndexedSlices concatenate (their rows' multiset), else dense.

    Example:
        >>> s = added(tf.IndexedSlices(tf.ones((1, 2)), tf.constant([3]), tf.constant([5, 2])),
        ...           tf.IndexedSlices(tf.ones((1, 2)), tf.constant([3]), tf.constant([5, 2])))
        >>> s.indices.numpy().tolist()
        [3, 3]
    """
    if a is None or b is None:
        return b if a is None else a
    if isinstance(a, tf.IndexedSlices) and isinstance(b, tf.IndexedSlices):
        return tf.IndexedSlices(tf.concat([a.values, b.values], 0), tf.concat([a.indices, b.indices], 0), a.dense_shape)
    return tf.convert_to_tensor(a) + tf.convert_to_tensor(b)


class SparseParts:
    """A step's IndexedSlices gradients, by variable position, kept out of the compiled (dense) sums.

    Keras's optimizers update only the rows an IndexedSlices names (Adam squares each listed row), so a
    step's sparse gradient must reach ``apply_gradients`` as the full batch's would: one IndexedSlices
    listing every micro-batch's rows. The parts stay in a python list (a concatenation grows per micro-batch:
    inside a compiled sum it would retrace each time) and join once, at the step's end.

    Example:
        >>> parts = SparseParts()
        >>> sums = parts.keep([tf.IndexedSlices(tf.ones((1, 2)), tf.constant([3]), tf.constant([5, 2])), tf.ones(2)])
        >>> sums[0] is None, parts.joined(sums)[0].indices.numpy().tolist()
        (True, [3])
    """

    def __init__(self) -> None:
        self.parts: Dict[int, List[tf.IndexedSlices]] = {}

    def keep(self, gradients: Optional[Sequence[Any]]) -> List[Any]:
        """``gradients`` with each IndexedSlices kept here and None in its place (what the dense sums add)."""
        out: List[Any] = []
        for p, g in enumerate(gradients or []):
            if isinstance(g, tf.IndexedSlices):
                self.parts.setdefault(p, []).append(g)
                g = None
            out.append(g)
        return out

    def joined(self, sums: Sequence[Any]) -> List[Any]:
        """``sums`` with the kept parts: one IndexedSlices where a variable had only sparse parts, else added dense."""
        out = list(sums)
        for p, parts in self.parts.items():
            out += [None] * (p + 1 - len(out))
            whole = parts[0] if len(parts) == 1 else tf.IndexedSlices(
                tf.concat([s.values for s in parts], 0), tf.concat([s.indices for s in parts], 0), parts[0].dense_shape)
            out[p] = added(out[p], whole)
        return out
