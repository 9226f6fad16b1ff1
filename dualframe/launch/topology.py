"""Topology: this process's rank, size, local and cross ranks, read from the launcher's variables."""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import List, Mapping, Optional

from dualframe.errors import TopologyError


@dataclass(frozen=True)
class Topology:
    """Where this process stands in the job, as the launcher described it before any ``init``.

    ``launcher`` is one of ``"horovodrun"``, ``"mpirun"`` (Open MPI), ``"pmi"`` (MPICH, Intel MPI,
    ``srun --mpi=pmi2``), ``"slurm"`` (a plain ``srun`` step) or ``"none"`` (a single process).

    Example:
        >>> topo = detect({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2"})
        >>> topo.rank, topo.size, topo.launcher
        (1, 2, 'mpirun')
    """

    rank: int = 0
    size: int = 1
    local_rank: int = 0
    local_size: int = 1
    cross_rank: int = 0
    cross_size: int = 1
    launcher: str = "none"

    def __post_init__(self) -> None:
        for name in ("size", "local_size", "cross_size"):
            if getattr(self, name) < 1:
                raise TopologyError(f"{name} must be >= 1 ({name}: {getattr(self, name)})")
        for name, limit in (("rank", "size"), ("local_rank", "local_size"), ("cross_rank", "cross_size")):
            value, bound = getattr(self, name), getattr(self, limit)
            if not 0 <= value < bound:
                raise TopologyError(f"{name} must be in [0, {limit}) ({name}: {value}, {limit}: {bound})")

    @property
    def distributed(self) -> bool:
        """True when a launcher started more than one process."""
        return self.size > 1


def _int(env: Mapping[str, str], name: str, default: Optional[int] = None) -> int:
    raw = env.get(name)
    if raw is None or raw == "":
        if default is None:
            raise TopologyError(f"launcher variable {name} is missing")
        return default
    try:
        return int(raw)
    except ValueError:
        raise TopologyError(f"launcher variable {name} must be an integer ({name}={raw!r})") from None


def _cross(rank: int, size: int, local_size: int) -> "tuple[int, int]":
    # Launchers other than Horovod's do not name the node index; with the usual block mapping
    # (ranks filled node by node) it is rank // local_size.
    if local_size > 0 and size % local_size == 0:
        return rank // local_size, size // local_size
    return 0, 1


def _open_mpi_cross(env: Mapping[str, str], rank: int, size: int, local_size: int) -> "tuple[int, int]":
    # `mpirun --map-by node` deals the ranks round-robin over the nodes (rank r on node r % nodes),
    # which rank // local_size gets wrong; Open MPI says so in its MCA variables.
    nodes = env.get("OMPI_MCA_orte_num_nodes", "")
    policy = env.get("OMPI_MCA_rmaps_base_mapping_policy", "").split(":")[0].lower()
    if policy == "node" and nodes.isdigit() and 0 < int(nodes) and size % int(nodes) == 0 \
            and size // int(nodes) == local_size:
        return rank % int(nodes), int(nodes)
    return _cross(rank, size, local_size)


def _slurm_tasks_per_node(value: str, node: int) -> int:
    """Parse SLURM_TASKS_PER_NODE such as ``"2(x3),1"`` and return node ``node``'s count."""
    counts: List[int] = []
    for part in value.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if not match:
            raise TopologyError(f"cannot parse SLURM_TASKS_PER_NODE={value!r}")
        counts.extend([int(match.group(1))] * int(match.group(2) or 1))
    if not 0 <= node < len(counts):
        raise TopologyError(f"SLURM_NODEID={node} is outside SLURM_TASKS_PER_NODE={value!r}")
    return counts[node]


def detect(environ: Optional[Mapping[str, str]] = None) -> Topology:
    """Read the topology from launcher variables; precedence HOROVOD_ > OMPI_ > PMI_ > SLURM_.

    Args:
        environ: the variables to read; ``os.environ`` by default.

    Returns:
        The Topology; a single process (rank 0 of 1) when no launcher is seen.

    Raises:
        TopologyError: a variable is not an integer, or the values contradict each other.
    """
    env = os.environ if environ is None else environ
    if "HOROVOD_RANK" in env and "HOROVOD_SIZE" in env:
        rank, size = _int(env, "HOROVOD_RANK"), _int(env, "HOROVOD_SIZE")
        return Topology(
            rank, size,
            _int(env, "HOROVOD_LOCAL_RANK", rank), _int(env, "HOROVOD_LOCAL_SIZE", size),
            _int(env, "HOROVOD_CROSS_RANK", 0), _int(env, "HOROVOD_CROSS_SIZE", 1),
            "horovodrun",
        )
    if "OMPI_COMM_WORLD_RANK" in env:
        rank, size = _int(env, "OMPI_COMM_WORLD_RANK"), _int(env, "OMPI_COMM_WORLD_SIZE")
        local_rank = _int(env, "OMPI_COMM_WORLD_LOCAL_RANK", rank)
        local_size = _int(env, "OMPI_COMM_WORLD_LOCAL_SIZE", size)
        return Topology(rank, size, local_rank, local_size, *_open_mpi_cross(env, rank, size, local_size), "mpirun")
    if "PMI_RANK" in env:
        rank, size = _int(env, "PMI_RANK"), _int(env, "PMI_SIZE")
        local_rank = _int(env, "MPI_LOCALRANKID", rank)
        local_size = _int(env, "MPI_LOCALNRANKS", size)
        return Topology(rank, size, local_rank, local_size, *_cross(rank, size, local_size), "pmi")
    # SLURM_PROCID is also set (to 0) in a batch script itself; only an srun step is a launch.
    if "SLURM_PROCID" in env and ("SLURM_STEP_ID" in env or "SLURM_STEPID" in env):
        rank = _int(env, "SLURM_PROCID")
        size = _int(env, "SLURM_STEP_NUM_TASKS", _int(env, "SLURM_NTASKS", 1))
        node = _int(env, "SLURM_NODEID", 0)
        nodes = _int(env, "SLURM_STEP_NUM_NODES", _int(env, "SLURM_NNODES", 1))
        tasks = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
        local_size = _slurm_tasks_per_node(tasks, node) if tasks else size
        return Topology(rank, size, _int(env, "SLURM_LOCALID", 0), local_size, node, nodes, "slurm")
    return Topology()
