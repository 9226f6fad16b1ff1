"""Mixed precision for sharded optimizers: which dtype a rank's slice keeps, reduces and travels in, and the one skip rule.

A model whose weights are float16 or bfloat16 is stepped through fp32 *master slices*: each rank's
optimizer slice holds fp32 copies of the weights it owns (and fp32 state), its reduced gradient is
cast up before the update, and the updated slice is cast down to the model's dtype and allgathered
into every rank's weights. A collective engine that cannot sum a dtype (Horovod has no bfloat16 sum)
reduces in the master dtype instead, and moves a slice it cannot carry as the same bits in an integer
of the same width (an allgather copies bits, it computes nothing).

Dynamic loss scaling with shards: each rank sees only its slice of the reduced gradient, so a rank
alone cannot tell whether the step overflowed. Each rank counts the non-finite values of its slices,
the counts are summed across the ranks (one allreduce of one number), and every rank skips the step,
and lowers the scale, exactly when the sum is not zero.

The adapters (``dualframe.torch.dp.shard.precision``, ``dualframe.tensorflow.dp.shard.precision``) hand
these rules their casts and their allreduce; ZeRO-3's parameter slices use the same
:class:`SlicePrecision` (the fp32 master is the slice a rank keeps; the gathered copy is in the model dtype).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

#: Floating dtypes stepped through fp32 master slices.
LOW_PRECISION = ("float16", "bfloat16")
#: The integer of each low-precision dtype's width: what a slice travels as when the engine lacks the dtype.
SAME_WIDTH_INT = {"float16": "int16", "bfloat16": "int16"}


def master_dtype(dtype: str) -> str:
    """The dtype of the master slice kept for weights of ``dtype`` (float32 for float16/bfloat16, else the same).

    Example:
        >>> master_dtype("bfloat16"), master_dtype("float16"), master_dtype("float32"), master_dtype("float64")
        ('float32', 'float32', 'float32', 'float64')
    """
    return "float32" if dtype in LOW_PRECISION else dtype


@dataclass(frozen=True)
class SlicePrecision:
    """The dtypes of one bucket of a sharded optimizer: the model's, the master slice's, the reduce's, the gather's.

    ``model`` is the weights' dtype, ``master`` the optimizer slice's (:func:`master_dtype`),
    ``reduce`` the dtype the gradients are summed in (the model's, or the master's when the engine
    cannot sum the model's), ``gather`` the dtype the updated slice is allgathered in (the model's,
    or an integer of its width when the engine cannot carry it: the bits arrive unchanged).

    Example:
        >>> p = SlicePrecision.of("bfloat16", carried=("float16", "float32", "float64", "int16"))
        >>> p.master, p.reduce, p.gather, p.has_master
        ('float32', 'float32', 'int16', True)
        >>> q = SlicePrecision.of("float16", carried=("float16", "float32"))
        >>> q.master, q.reduce, q.gather, SlicePrecision.of("float32", carried=("float32",)).has_master
        ('float32', 'float16', 'float16', False)
    """

    model: str
    master: str
    reduce: str
    gather: str

    @classmethod
    def of(cls, model: str, carried: Sequence[str]) -> "SlicePrecision":
        """The dtypes for weights of ``model`` dtype, given the dtypes the collective engine ``carried`` (sums and moves)."""
        master = master_dtype(model)
        reduce = model if model in carried else master
        gather = model if model in carried else SAME_WIDTH_INT.get(model, master)
        return cls(model=model, master=master, reduce=reduce, gather=gather)

    @property
    def has_master(self) -> bool:
        """Whether the slice is a separate copy in a wider dtype (the model's weights are refreshed from it)."""
        return self.master != self.model

