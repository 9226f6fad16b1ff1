"""dualframe: data, model and pipeline parallelism for PyTorch and TensorFlow/Keras 3 over Horovod.

The top-level package is framework-neutral: it imports neither torch, TensorFlow, Keras nor Horovod.
Frameworks live in the adapters ``dualframe.torch``, ``dualframe.tensorflow`` and
``dualframe.tensorflow.keras`` (also ``dualframe.keras``).
"""
from dualframe.errors import (
    BalanceError,
    ChunksError,
    DeviceError,
    DualframeError,
    MissingDependencyError,
    NotInitializedError,
    ScheduleError,
    StrategyError,
    TopologyError,
)
# strategies: what to spread and how
from dualframe.strategy import DataParallel, Hybrid, ModelParallel, Pipeline, RankGrid, Strategy
# pipelines: partitions and micro-batches
from dualframe.pipeline.microbatch import micro_batch_offsets, micro_batch_sizes
from dualframe.pipeline.partition import balance_by_cost, partition_ranges, validate_balance
# launching: where this process stands
from dualframe.launch.topology import Topology, detect as detect_topology


__version__ = "0.1.0"

__all__ = [
    "BalanceError", "ChunksError", "DeviceError", "DualframeError", "MissingDependencyError",
    "NotInitializedError", "ScheduleError", "StrategyError", "TopologyError",
    "micro_batch_offsets", "micro_batch_sizes", "balance_by_cost", "partition_ranges",
    "validate_balance", "DataParallel", "Hybrid", "ModelParallel", "Pipeline", "RankGrid",
    "Strategy", "Topology", "detect_topology", "__version__",
]
