"""A Keras sharded optimizer's state as the plain optimizer's: gathered from the slices, scattered back, its bytes.

The plain layout is the ``variables`` of the same optimizer built on the model: its non-slot variables,
then each model variable's slots in order (``ShardedState.gather_state``). Saving gathers it (a
collective: every rank calls ``model.save``); loading takes this rank's slices for the current number of
ranks, so state saved at one size (or by a plain optimizer) loads at another. A mixin of
``dualframe.tensorflow.dp.shard.optimizer.ShardedOptimizer`` (torch's twin:
``dualframe.torch.dp.shard.state_dict``).
"""
from __future__ import annotations

from typing import Any, List, Sequence

import numpy as np

from dualframe.tensorflow.dp.shard.slices import ShardedState


def _bytes(variables: Sequence[Any]) -> int:
    return sum(int(np.prod(v.shape)) * np.dtype(str(v.dtype)).itemsize for v in variables)


class PlainState:
    """The sharded state in the plain optimizer's layout (``state_arrays``, Keras saving) and what a rank holds.

    Example:
        >>> arrays = opt.state_arrays()     # every rank: the plain optimizer's variables   # doctest: +SKIP
        >>> other.load_state_arrays(arrays)  # any number of ranks: each takes its slices     # doctest: +SKIP
    """

    # Set by ShardedOptimizer.__init__.
    reduction: Any
    _zero: ShardedState

    def parameter_bytes(self) -> int:
        """Bytes of this rank's slices of the parameters (with ``shard="parameters"``, all of them it keeps)."""
        return _bytes(self._zero.slices)

    def shard_variables(self) -> List[Any]:
        """This rank's slot variables (each covering one bucket's slice)."""
        return self._zero.slot_variables()

    def state_bytes(self) -> int:
        """Bytes of this rank's optimizer slot variables (the state ZeRO shards)."""
        return _bytes(self.shard_variables())

    def state_arrays(self) -> List[np.ndarray]:
        """The full optimizer state in the plain optimizer's ``variables`` order (a collective: every rank calls)."""
        return self._zero.gather_state(self.reduction.process_set)

    def load_state_arrays(self, arrays: Sequence[np.ndarray]) -> None:
        """Take this rank's slices of a plain optimizer's ``variables`` values (no communication)."""
        self._zero.scatter_state(arrays)

    def save_own_variables(self, store: Any) -> None:
        """Keras saving: the plain optimizer's layout, gathered (every rank must call ``model.save``)."""
        for i, array in enumerate(self.state_arrays()):
            store[str(i)] = array

    def load_own_variables(self, store: Any) -> None:
        """Keras loading: a plain optimizer's saved variables, this rank keeping its slices."""
        self.load_state_arrays([np.asarray(store[str(i)]) for i in range(len(store.keys()))])
