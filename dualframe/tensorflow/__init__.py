"""TensorFlow adapter: Horovod's TF API on Keras 3 plus dualframe's strategies (``import dualframe.tensorflow as hvd``).

Sections, in the same order as ``dualframe.torch``: collectives and basics, data parallelism, model
split and pipelines in one process, process pipelines, reliability, observing. The Keras API
(``dualframe.tensorflow.keras``) re-exports all of this plus the Keras parts, whose code lives in this
package too (``optimizer``, ``callbacks``, ``saving``, ``checkpoint``, ``elastic``), as Horovod's ``_keras``.
"""
# --- Collectives and basics: start Horovod, who am I, reduce / gather / broadcast ----------------------------
from dualframe.tensorflow.collectives import (
    OPS,
    TFBatchOps,
    TFCaster,
    TFCollectives,
    collectives,
    hvd as _hvd,
)
from dualframe.tensorflow.functions import (
    allgather,
    allgather_object,
    allreduce,
    barrier,
    broadcast,
    broadcast_object,
    broadcast_variables,
    cross_rank,
    cross_size,
    local_rank,
    local_size,
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

# Horovod's own, unchanged: they work on Keras 3 as they are.
ProcessSet = _hvd.ProcessSet
global_process_set = _hvd.global_process_set
add_process_set = _hvd.add_process_set
remove_process_set = _hvd.remove_process_set
grouped_allreduce = _hvd.grouped_allreduce
alltoall = _hvd.alltoall
reducescatter = _hvd.reducescatter
join = _hvd.join
is_homogeneous = _hvd.is_homogeneous
mpi_enabled = _hvd.mpi_enabled
mpi_built = _hvd.mpi_built
gloo_enabled = _hvd.gloo_enabled
gloo_built = _hvd.gloo_built
nccl_built = _hvd.nccl_built
cuda_built = _hvd.cuda_built
mpi_threads_supported = _hvd.mpi_threads_supported
ccl_built = _hvd.ccl_built
grouped_allgather = _hvd.grouped_allgather
grouped_reducescatter = _hvd.grouped_reducescatter
broadcast_ = _hvd.broadcast_  # in place, on tf.Variables
broadcast_object_fn = _hvd.broadcast_object_fn
broadcast_global_variables = _hvd.broadcast_global_variables  # TF 1 graph mode, as Horovod's
rank_op = _hvd.rank_op
local_rank_op = _hvd.local_rank_op
size_op = _hvd.size_op
local_size_op = _hvd.local_size_op
process_set_included_op = _hvd.process_set_included_op
ddl_built = _hvd.ddl_built
rocm_built = _hvd.rocm_built
gpu_available = _hvd.gpu_available
# Horovod's helpers that its TF module exports too (unchanged).
check_extension = _hvd.check_extension
check_num_rank_power_of_2 = _hvd.check_num_rank_power_of_2
handle_average_backwards_compatibility = _hvd.handle_average_backwards_compatibility
split_list = _hvd.split_list
refs_to_vars = _hvd.refs_to_vars
vars_to_refs = _hvd.vars_to_refs

__all__ = [
    "OPS", "TFBatchOps", "TFCaster", "TFCollectives", "collectives",
    "Average", "Sum", "Adasum", "Min", "Max", "Product",
    "init", "is_initialized", "rank", "size", "shutdown", "local_rank", "local_size", "cross_rank",
    "cross_size", "allreduce", "allgather", "broadcast", "broadcast_variables", "broadcast_object",
    "allgather_object", "barrier", "grouped_allreduce", "alltoall", "reducescatter", "join",
    "ProcessSet", "global_process_set", "add_process_set", "remove_process_set", "is_homogeneous",
    "mpi_enabled", "mpi_built", "gloo_enabled", "gloo_built", "nccl_built", "cuda_built", "mpi_threads_supported",
    "ccl_built", "grouped_allgather", "grouped_reducescatter", "broadcast_", "broadcast_object_fn",
    "broadcast_global_variables", "rank_op", "local_rank_op", "size_op", "local_size_op", "process_set_included_op",
    "ddl_built", "rocm_built", "gpu_available", "check_extension", "check_num_rank_power_of_2",
    "handle_average_backwards_compatibility", "split_list", "refs_to_vars", "vars_to_refs",
]

# --- Data parallelism: gradients averaged across ranks (Keras: DistributedOptimizer, callbacks) --------------
from dualframe.tensorflow.dp.compression import Compression  # noqa: E402
from dualframe.tensorflow.dp.data import shard  # noqa: E402
from dualframe.tensorflow.dp.gradient_tape import DistributedGradientTape, PartialDistributedGradientTape  # noqa: E402
from dualframe.tensorflow.dp.legacy_optimizer import DistributedOptimizer  # noqa: E402
from dualframe.tensorflow.dp.distribute import distribute  # noqa: E402
from dualframe.tensorflow.dp.sync_batch_norm import SyncBatchNormalization  # noqa: E402

# Horovod's TF 1 gradient accumulation helper, unchanged (its DistributedOptimizer for TF 1 optimizers uses it).
LocalGradientAggregationHelper = _hvd.LocalGradientAggregationHelper

__all__ += ["DistributedGradientTape", "PartialDistributedGradientTape", "SyncBatchNormalization", "Compression",
            "shard", "distribute", "DistributedOptimizer", "LocalGradientAggregationHelper"]

# --- Model split and pipelines in one process ------------------------------------------------------------------
from dualframe.tensorflow.split.balance import balance_by_size, balance_by_time  # noqa: E402
from dualframe.tensorflow.split.model_parallel import ModelParallel, logical_cpus, stage_devices  # noqa: E402
from dualframe.tensorflow.split.pipeline import Pipeline  # noqa: E402

__all__ += ["ModelParallel", "Pipeline", "logical_cpus", "stage_devices", "balance_by_size", "balance_by_time"]

# --- Process pipelines: each stage a process, and data x pipeline ---------------------------------------------
from dualframe.pipeline.layout import PeerLostError  # noqa: E402
from dualframe.tensorflow.pipeline.distributed import DistributedPipeline  # noqa: E402

__all__ += ["DistributedPipeline", "PeerLostError"]

# --- Reliability: failure, checkpoints, elastic -----------------------------------------------------------------
# A custom tf.function step bounded by the stall watchdog (Keras fit: hvd.callbacks.StallGuardCallback).
from dualframe.tensorflow.reliability.failure import stall_guard  # noqa: E402
# Process pipelines' checkpoints: each stage saves its part, resumes, a merge gives the full model's.
from dualframe.tensorflow.reliability.stage_checkpoint import (  # noqa: E402
    load_stage_checkpoint,
    merge_stage_checkpoints,
    save_stage_checkpoint,
)
# hvd.elastic (run, TensorFlowKerasState, TensorFlowState): a submodule as in Horovod, not in __all__.
from dualframe.tensorflow.reliability import elastic  # noqa: E402,F401

__all__ += ["stall_guard", "save_stage_checkpoint", "load_stage_checkpoint", "merge_stage_checkpoints"]

# --- Observing ---------------------------------------------------------------------------------------------------
start_timeline = _hvd.start_timeline
stop_timeline = _hvd.stop_timeline

__all__ += ["start_timeline", "stop_timeline"]
