"""The batches of a Keras process pipeline's fit, evaluate and predict: Keras's own iterators, the same on every rank, each replica's share.

Every rank reads the whole input (arrays, a ``tf.data.Dataset``, a generator or a ``PyDataset``) through
Keras's ``EpochIterator``, so batches are cut as ``keras.Model.fit`` cuts them; the first stage then
keeps the inputs, the last the targets, and replica r of a hybrid the r-th of ``replicas`` equal shares
of each global batch. Arrays are shuffled by a permutation drawn from a seed every rank shares.
Before the first step the ranks compare their descriptions of the data (``fit_plan.check_same``) and,
with arrays, every batch's rows (``fit_plan.check_batches``); an input of unknown length (a generator)
agrees after each batch whether every rank still has one.
"""
from __future__ import annotations

import warnings
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import keras
import numpy as np
from keras.src.trainers.data_adapters import array_data_adapter, data_adapter_utils
from keras.src.trainers.epoch_iterator import EpochIterator

from dualframe.errors import DataError
from dualframe.pipeline.fit_plan import batch_rows, check_batches, replica_rows, validation_split_rows

Batch = Tuple[Any, Any]


def _rows(x: Any) -> int:
    return int(keras.tree.flatten(x)[0].shape[0])


def _take(structure: Any, index: Any) -> Any:
    return None if structure is None else keras.tree.map_structure(lambda a: np.asarray(a)[index], structure)


def split_validation(x: Any, y: Any, split: float) -> Tuple[Batch, Batch]:
    """Keras's ``validation_split`` on arrays: ((x, y) to train on, (x, y) to validate on, the last rows).

    Raises:
        DataError: inputs that are not arrays, or a split that leaves a side without rows.
    """
    if not array_data_adapter.can_convert_arrays((x, y)):
        raise DataError(f"validation_split works on arrays only (x: {type(x).__name__}); pass validation_data= "
                        f"for a dataset or a generator")
    train, _ = validation_split_rows(_rows(x), split)
    return (_take(x, slice(0, train)), _take(y, slice(0, train))), (_take(x, slice(train, None)),
                                                                   _take(y, slice(train, None)))


class PipelineData:
    """One input of fit/evaluate/predict, batch by batch and epoch by epoch, the same on every rank.

    Args:
        x, y: what ``keras.Model.fit`` takes (arrays or dicts of them with ``y``; a ``tf.data.Dataset``,
            generator or ``PyDataset`` yielding ``(x, y)`` or ``x``).
        batch_size: global rows per batch (arrays only; default 32, as Keras).
        steps: batches per epoch (``steps_per_epoch``); None: the whole input.
        shuffle: shuffle arrays each epoch with a permutation seeded by ``seed``.
        seed: the same on every rank.
        agree: ``agree(has_batch) -> every rank has one`` (a collective), for inputs of unknown length.

    Example:
        >>> data = PipelineData(x, y, 32, None, True, seed, agree)                  # doctest: +SKIP
        >>> for x_batch, y_batch in data.epoch(0): ...                              # doctest: +SKIP
    """

    def __init__(self, x: Any, y: Any, batch_size: Optional[int], steps: Optional[int], shuffle: bool, seed: int,
                 agree: Callable[[bool], bool]) -> None:
        self.arrays = array_data_adapter.can_convert_arrays((x, y))
        self.x, self.y, self.steps, self.seed, self.agree = x, y, steps, seed, agree
        self.shuffle = bool(shuffle) and self.arrays
        self.batch_size = (batch_size or 32) if self.arrays else batch_size
        self._iterator = None if self.shuffle else self._keras_iterator(x, y)
        self.samples = _rows(x) if self.arrays else None
        self.rows: Optional[List[int]] = batch_rows(self.samples, batch_size or 32, steps) if self.samples else None
        known = self._iterator.num_batches if self._iterator is not None else len(self.rows or [])
        self.num_batches: Optional[int] = steps or known

    def _keras_iterator(self, x: Any, y: Any) -> EpochIterator:
        return EpochIterator(x=x, y=y, batch_size=self.batch_size, steps_per_epoch=self.steps, shuffle=False)

    def describe(self) -> Dict[str, Any]:
        """What every rank must share: the kind of input, its batches and their rows (arrays)."""
        return {"input": type(self.x).__name__, "batches": self.num_batches, "batch rows": self.rows,
                "batch_size": self.batch_size, "shuffle": self.shuffle}

    def check(self, replicas: int, chunks: int, what: str) -> None:
        """Before any step: every batch of arrays splits among the replicas, each share at least ``chunks`` rows."""
        if self.rows is not None:
            check_batches(self.rows, replicas, chunks, f"{what} batch")

    def epoch(self, epoch: int) -> Iterator[Batch]:
        """The epoch's global batches as ``(x, y)`` (``y`` None where the input has no targets)."""
        iterator = self._iterator
        if iterator is None:  # shuffled arrays: this epoch's permutation, the same on every rank
            order = np.random.RandomState((self.seed + epoch) % 2 ** 32).permutation(int(self.samples or 0))
            iterator = self._keras_iterator(_take(self.x, order), _take(self.y, order))
        unknown = self.num_batches is None
        with warnings.catch_warnings(), iterator.catch_stop_iteration():
            # An input of unknown length ends by running out, every epoch: Keras's warning says nothing new.
            warnings.filterwarnings("ignore", message="Your input ran out of data")
            for _, _, buffer in iterator:
                if unknown and not self.agree(True):
                    return
                x, y, _ = data_adapter_utils.unpack_x_y_sample_weight(buffer[0])
                yield x, y
        if unknown:
            self.agree(False)


def replica_share(batch: Batch, replica: int, replicas: int, chunks: int, what: str) -> Batch:
    """Replica ``replica``'s rows of a global batch (its r-th equal share), checked on every rank alike."""
    x, y = batch
    rows = replica_rows(_rows(x), replicas, chunks, what)
    if replicas == 1:
        return x, y
    index = slice(replica * rows, (replica + 1) * rows)
    return _take(x, index), _take(y, index)
