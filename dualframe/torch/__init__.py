"""PyTorch adapter: Horovod's torch API plus dualframe's strategies (``import dualframe.torch as hvd``)."""
from dualframe.torch.collectives import (
    OPS,
    TorchBatchOps,
    TorchCaster,
    TorchCollectives,
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


def allreduce(tensor, average=None, name=None, compression=None, op=None, prescale_factor=1.0,
              postscale_factor=1.0, process_set=None):
    """Horovod's ``allreduce``; see horovod.torch.allreduce."""
    kwargs = {} if process_set is None else {"process_set": process_set}
    if compression is not None:
        kwargs["compression"] = compression
    return _hvd.allreduce(tensor, average=average, name=name, op=op, prescale_factor=prescale_factor,
                          postscale_factor=postscale_factor, **kwargs)


__all__ = [
    "OPS", "TorchBatchOps", "TorchCaster", "TorchCollectives", "collectives",
    "Average", "Sum", "Adasum", "Min", "Max", "Product",
    "init", "is_initialized", "rank", "size", "shutdown", "allreduce",
]

# Model split and GPipe pipeline in one process (issue 5).
from dualframe.torch.balance import balance_by_size, balance_by_time  # noqa: E402
from dualframe.torch.deferred_batch_norm import DeferredBatchNorm  # noqa: E402
from dualframe.torch.model_parallel import ModelParallel  # noqa: E402
from dualframe.torch.pipeline import Pipeline  # noqa: E402

__all__ += ["ModelParallel", "Pipeline", "DeferredBatchNorm", "balance_by_size", "balance_by_time"]

# Pipelines whose stages are processes, and hybrid data x pipeline (issue 6).
from dualframe.torch.distributed_pipeline import DistributedPipeline  # noqa: E402
from dualframe.torch.pipeline_transport import PeerLostError  # noqa: E402

__all__ += ["DistributedPipeline", "PeerLostError"]

# Checkpoints with exact resume, and pipeline stages' parts merged (issue 8).
from dualframe.torch.checkpoint import TrainingState, load_checkpoint, merge_stage_checkpoints, save_checkpoint  # noqa: E402

__all__ += ["TrainingState", "load_checkpoint", "merge_stage_checkpoints", "save_checkpoint"]
