"""PyTorch adapter: Horovod's torch API plus dualframe's strategies (``import dualframe.torch as hvd``).

Sections, in the same order as ``dualframe.tensorflow``: collectives and basics, data parallelism, model
split and pipelines in one process, process pipelines, reliability, observing.
"""
# --- Collectives and basics: start Horovod, who am I, reduce / gather / broadcast ----------------------------
from dualframe.torch.collectives import (
    OPS,
    TorchBatchOps,
    TorchCaster,
    TorchCollectives,
    collectives,
    hvd as _hvd,
)
from dualframe.torch.functions import (
    allgather_object,
    broadcast_object,
    init,
    wrapped as _wrapped,
)

# Horovod's constants and classes, unchanged.
Average, Sum, Adasum, Min, Max, Product = (_hvd.Average, _hvd.Sum, _hvd.Adasum, _hvd.Min, _hvd.Max, _hvd.Product)
ProcessSet = _hvd.ProcessSet
global_process_set = _hvd.global_process_set
HorovodInternalError = _hvd.HorovodInternalError
shutdown = _hvd.shutdown
is_initialized = _hvd.is_initialized
mpi_built, gloo_built, nccl_built = _hvd.mpi_built, _hvd.gloo_built, _hvd.nccl_built
ddl_built, ccl_built, cuda_built, rocm_built = _hvd.ddl_built, _hvd.ccl_built, _hvd.cuda_built, _hvd.rocm_built

# Horovod's functions that need a running Horovod: refused with a clear error before init(),
# tensors, ops and root ranks checked before any communication.
_CHECKED = _wrapped([
    "rank", "size", "local_rank", "local_size", "cross_rank", "cross_size",
    "mpi_threads_supported", "mpi_enabled", "gloo_enabled",
    "add_process_set", "remove_process_set",
    "allreduce", "allreduce_", "allreduce_async", "allreduce_async_",
    "grouped_allreduce", "grouped_allreduce_", "grouped_allreduce_async", "grouped_allreduce_async_",
    "sparse_allreduce_async", "allgather", "allgather_async", "grouped_allgather", "grouped_allgather_async",
    "broadcast", "broadcast_", "broadcast_async", "broadcast_async_", "alltoall", "alltoall_async",
    "reducescatter", "reducescatter_async", "grouped_reducescatter", "grouped_reducescatter_async",
    "join", "barrier", "poll", "synchronize",
])
rank = _CHECKED["rank"]
size = _CHECKED["size"]
local_rank = _CHECKED["local_rank"]
local_size = _CHECKED["local_size"]
cross_rank = _CHECKED["cross_rank"]
cross_size = _CHECKED["cross_size"]
mpi_threads_supported = _CHECKED["mpi_threads_supported"]
mpi_enabled = _CHECKED["mpi_enabled"]
gloo_enabled = _CHECKED["gloo_enabled"]
add_process_set = _CHECKED["add_process_set"]
remove_process_set = _CHECKED["remove_process_set"]
allreduce = _CHECKED["allreduce"]
allreduce_ = _CHECKED["allreduce_"]
allreduce_async = _CHECKED["allreduce_async"]
allreduce_async_ = _CHECKED["allreduce_async_"]
grouped_allreduce = _CHECKED["grouped_allreduce"]
grouped_allreduce_ = _CHECKED["grouped_allreduce_"]
grouped_allreduce_async = _CHECKED["grouped_allreduce_async"]
grouped_allreduce_async_ = _CHECKED["grouped_allreduce_async_"]
sparse_allreduce_async = _CHECKED["sparse_allreduce_async"]
allgather = _CHECKED["allgather"]
allgather_async = _CHECKED["allgather_async"]
grouped_allgather = _CHECKED["grouped_allgather"]
grouped_allgather_async = _CHECKED["grouped_allgather_async"]
broadcast = _CHECKED["broadcast"]
broadcast_ = _CHECKED["broadcast_"]
broadcast_async = _CHECKED["broadcast_async"]
broadcast_async_ = _CHECKED["broadcast_async_"]
alltoall = _CHECKED["alltoall"]
alltoall_async = _CHECKED["alltoall_async"]
reducescatter = _CHECKED["reducescatter"]
reducescatter_async = _CHECKED["reducescatter_async"]
grouped_reducescatter = _CHECKED["grouped_reducescatter"]
grouped_reducescatter_async = _CHECKED["grouped_reducescatter_async"]
join = _CHECKED["join"]
barrier = _CHECKED["barrier"]
poll = _CHECKED["poll"]
synchronize = _CHECKED["synchronize"]

__all__ = [
    "OPS", "TorchBatchOps", "TorchCaster", "TorchCollectives", "collectives",
    "Average", "Sum", "Adasum", "Min", "Max", "Product", "ProcessSet", "global_process_set",
    "HorovodInternalError", "init", "shutdown", "is_initialized",
    "mpi_built", "gloo_built", "nccl_built", "ddl_built", "ccl_built", "cuda_built", "rocm_built",
    "broadcast_object", "allgather_object",
    *_CHECKED,
]

# --- Data parallelism: gradients averaged across ranks, data shards, LR warm-up ---------------------------------
from dualframe.torch.dp.compression import Compression  # noqa: E402
from dualframe.torch.dp.distribute import distribute  # noqa: E402
from dualframe.torch.functions import broadcast_optimizer_state, broadcast_parameters  # noqa: E402
from dualframe.torch.dp.optimizer import DistributedOptimizer  # noqa: E402
from dualframe.torch.dp.shard.precision import ShardedGradScaler  # noqa: E402
from dualframe.torch.dp.sync_batch_norm import SyncBatchNorm  # noqa: E402
from dualframe.torch.dp.helpers import (  # noqa: E402
    distributed_sampler,
    metric_average,
    shard_batch,
    warmup_lr_scheduler,
)

__all__ += ["Compression", "DistributedOptimizer", "ShardedGradScaler", "SyncBatchNorm", "distribute",
            "broadcast_parameters", "broadcast_optimizer_state",
            "distributed_sampler", "shard_batch", "metric_average", "warmup_lr_scheduler"]

# --- Model split and pipelines in one process ------------------------------------------------------------------
from dualframe.torch.split.balance import balance_by_size, balance_by_time  # noqa: E402
from dualframe.torch.split.deferred_batch_norm import DeferredBatchNorm  # noqa: E402
from dualframe.torch.split.model_parallel import ModelParallel  # noqa: E402
from dualframe.torch.split.pipeline import Pipeline  # noqa: E402

__all__ += ["ModelParallel", "Pipeline", "DeferredBatchNorm", "balance_by_size", "balance_by_time"]

# --- Process pipelines: each stage a process, and data x pipeline ---------------------------------------------
from dualframe.torch.pipeline.distributed import DistributedPipeline  # noqa: E402
from dualframe.torch.pipeline.link import PeerLostError  # noqa: E402

__all__ += ["DistributedPipeline", "PeerLostError"]

# --- Reliability: failure, checkpoints, elastic -----------------------------------------------------------------
# Checkpoints with exact resume, and process pipelines' stage parts merged into the full model's.
from dualframe.torch.reliability.checkpoint import TrainingState, load_checkpoint, save_checkpoint  # noqa: E402
from dualframe.torch.reliability.stage_checkpoint import (  # noqa: E402
    load_stage_checkpoint,
    merge_stage_checkpoints,
    save_stage_checkpoint,
)
# hvd.elastic (run, TorchState): a submodule as in Horovod.
from dualframe.torch.reliability import elastic  # noqa: E402

__all__ += ["TrainingState", "load_checkpoint", "merge_stage_checkpoints", "save_checkpoint",
            "save_stage_checkpoint", "load_stage_checkpoint", "elastic"]

# --- Observing: rank-0 output, Horovod's timeline ----------------------------------------------------------------
from dualframe.torch.dp.helpers import is_root, log, progress  # noqa: E402

_OBSERVING = _wrapped(["start_timeline", "stop_timeline"])
start_timeline = _OBSERVING["start_timeline"]
stop_timeline = _OBSERVING["stop_timeline"]

__all__ += ["is_root", "log", "progress", *_OBSERVING]
