"""TensorFlow adapter: Horovod's TF API on Keras 3 plus dualframe's strategies (``import dualframe.tensorflow as hvd``)."""
from dualframe.tensorflow.collectives import (
    OPS,
    TFBatchOps,
    TFCaster,
    TFCollectives,
    collectives,
    hvd as _hvd,
)

Average = _hvd.Average
Sum = _hvd.Sum
Adasum = _hvd.Adasum
Min = _hvd.Min
Max = _hvd.Max
Product = _hvd.Product

init = collectives.init
is_initialized = collectives.is_initialized
rank = collectives.rank
size = collectives.size
shutdown = _hvd.shutdown
allreduce = _hvd.allreduce

__all__ = [
    "OPS", "TFBatchOps", "TFCaster", "TFCollectives", "collectives",
    "Average", "Sum", "Adasum", "Min", "Max", "Product",
    "init", "is_initialized", "rank", "size", "shutdown", "allreduce",
]
