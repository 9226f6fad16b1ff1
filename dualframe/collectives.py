"""Horovod's collectives written once for both adapters: the op-name table, the init check, the one ``init``.

Each adapter hands in its Horovod module (``horovod.torch`` or ``horovod.tensorflow``, never
imported here) and its package name for the error text; ``HorovodCollectives`` then implements
the core's ``Collectives`` protocol (``dualframe.backend``) on that framework's tensors.
"""
from __future__ import annotations

import contextlib
import os
import sys
from typing import Any, ContextManager, Dict, Generic, List, Optional, Sequence, Tuple, TypeVar, Union

from dualframe.errors import NotInitializedError, StrategyError, TopologyError
from dualframe.launch.mpi_world import start_mpi
from dualframe.launch.topology import detect
from dualframe.reliability import failure
from dualframe.reliability.checkpoint import split_gathered
from dualframe.strategy import REDUCE_OPS

T = TypeVar("T")
ProcessSetsArg = Union[None, str, Sequence[Any]]

#: Core op names -> the attribute of Horovod's op constant.
OP_CONSTANTS: Dict[str, str] = {
    "average": "Average", "sum": "Sum", "adasum": "Adasum", "min": "Min", "max": "Max", "product": "Product",
}
assert set(OP_CONSTANTS) == set(REDUCE_OPS)


def horovod_ops(hvd: Any) -> Dict[str, object]:
    """Core op names -> ``hvd``'s op constants."""
    return {name: getattr(hvd, constant) for name, constant in OP_CONSTANTS.items()}


def check_process_sets(hvd: Any, process_sets: ProcessSetsArg, world_size: int) -> Any:
    """What ``hvd.init(process_sets=...)`` takes for rank lists, ``hvd.ProcessSet`` objects or ``"dynamic"``.

    Rank lists become ``hvd.ProcessSet`` objects; given ones pass as they are (Horovod gives them
    their ids); None and ``"dynamic"`` pass unchanged.

    Raises:
        StrategyError: not a list nor ``"dynamic"``, or a set naming a rank outside ``[0, world_size)``,
            twice, or none.
    """
    if process_sets is None or process_sets == "dynamic":
        return process_sets
    if isinstance(process_sets, str) or not isinstance(process_sets, Sequence):
        raise StrategyError(
            f"process_sets must be a list of hvd.ProcessSet or rank lists, or 'dynamic' (process_sets: {process_sets!r})"
        )
    converted = []
    for k, entry in enumerate(process_sets):
        ranks = entry.ranks if isinstance(entry, hvd.ProcessSet) else entry
        if ranks is None or not all(isinstance(r, int) and not isinstance(r, bool) for r in ranks):
            raise StrategyError(f"process_sets[{k}] must list integer ranks (process_sets[{k}]: {entry!r})")
        bad = [r for r in ranks if not 0 <= r < world_size]
        if bad or len(set(ranks)) != len(ranks) or not ranks:
            raise StrategyError(
                f"process_sets[{k}] must list distinct ranks in [0, {world_size}) (ranks: {list(ranks)}, "
                f"world size: {world_size})"
            )
        converted.append(entry if isinstance(entry, hvd.ProcessSet) else hvd.ProcessSet(list(ranks)))
    return converted


class HorovodCollectives(Generic[T]):
    """The core's ``Collectives`` over one framework's Horovod module.

    The adapter's subclass gives the conversions the byte collectives need (``byte_tensor``,
    ``int64_tensor``, ``host_bytes``) and, where an eager wait must be bounded, ``guard``.

    Args:
        hvd: ``horovod.torch`` or ``horovod.tensorflow``.
        package: the adapter's package, named in errors (``"dualframe.torch"``).

    Example:
        >>> import horovod.torch as hvd                                  # doctest: +SKIP
        >>> collectives = HorovodCollectives(hvd, "dualframe.torch")     # doctest: +SKIP
        >>> collectives.init(); collectives.allreduce(torch.ones(2), op="sum")  # doctest: +SKIP
    """

    def __init__(self, hvd: Any, package: str) -> None:
        self.hvd, self.package = hvd, package
        self.ops = horovod_ops(hvd)
        self._comm: Any = None  # the first init's, for a restart (join_process_sets)

    def op_of(self, op: object) -> object:
        """Horovod's op for a core op name or a Horovod op constant.

        Raises:
            StrategyError: neither a core op name nor one of Horovod's constants.
        """
        if isinstance(op, str):
            if op.lower() not in self.ops:
                raise StrategyError(f"unknown op {op!r}; choose one of {', '.join(REDUCE_OPS)}")
            return self.ops[op.lower()]
        if op in self.ops.values():
            return op
        raise StrategyError(f"unknown op {op!r}; use one of hvd.Average, hvd.Sum, hvd.Adasum, hvd.Min, hvd.Max")

    def check_initialized(self, what: str) -> None:
        """Raise NotInitializedError naming ``what`` unless Horovod is running."""
        if not self.hvd.is_initialized():
            raise NotInitializedError(
                f"{what} needs {self.package}.init() first (call hvd.init() at the top of the script)")

    def init(self, comm: Any = None, process_sets: ProcessSetsArg = None) -> None:
        """Start Horovod once (Horovod's ``init(comm, process_sets)``, in its order); later calls join process sets.

        A later call (Horovod running) registers the ``process_sets`` it names (``join_process_sets``);
        without any, it does nothing.

        Args:
            comm: an mpi4py communicator or a list of ranks, as in Horovod.
            process_sets: rank lists, ``hvd.ProcessSet`` objects or ``"dynamic"`` (see ``check_process_sets``),
                checked against the launcher's world size before Horovod starts (under a launcher).

        Raises:
            StrategyError: a process set names a rank outside the job, before Horovod starts.
        """
        if self.hvd.is_initialized():
            self.join_process_sets(process_sets)
            return
        try:
            topology = detect()
            # Without a launcher (one process, or ranks started by hand) Horovod alone knows the world.
            world_size = topology.size if topology.launcher != "none" else 1 << 30
        except TopologyError:
            world_size = 1 << 30  # unreadable launcher variables: leave the check to Horovod
        self._start(comm, check_process_sets(self.hvd, process_sets, world_size))
        # Elastic ranks join at other times, and a comm may be a subset: no allgather on the world there.
        if comm is None and self._distributed() and os.environ.get("HOROVOD_ELASTIC") != "1":
            failure.watch_peers(self.gather_bytes, int(self.hvd.rank()))

    def _start(self, comm: Any, process_sets: Any) -> None:
        arguments = {"process_sets": process_sets}
        self._comm = comm
        if comm is not None:
            arguments["comm"] = comm
        else:
            start_mpi()  # MPI owned by mpi4py: a rank that finishes first no longer finalizes it under the others
        self.hvd.init(**arguments)

    def join_process_sets(self, process_sets: ProcessSetsArg) -> None:
        """Register ``process_sets`` with a running Horovod; every rank calls it alike (``init`` does).

        Each rank list Horovod runs already gives its id to the set naming it. The others are added
        (``hvd.add_process_set``) under dynamic process sets, else Horovod restarts with the sets it ran
        (their ids kept) and the new ones: one script part (a test file) may start Horovod plainly and a
        later one name sets of its own. Nothing under elastic Horovod, where ranks join at other times.

        Raises:
            StrategyError: a process set names a rank outside the job, before any change.
        """
        if process_sets is None or process_sets == "dynamic" or os.environ.get("HOROVOD_ELASTIC") == "1":
            return
        sets = [s for s in check_process_sets(self.hvd, process_sets, int(self.hvd.size())) if s.ranks is not None]
        running = self._running_sets()
        new = [s for s in sets if tuple(sorted(s.ranks)) not in running]
        if new and os.environ.get("HOROVOD_DYNAMIC_PROCESS_SETS") == "1":
            for added in new:
                self.hvd.add_process_set(added)
        elif new:
            kept = [self.hvd.ProcessSet(list(ranks)) for ranks, k in sorted(running.items(), key=lambda r: r[1]) if k]
            self.hvd.shutdown()
            self._start(self._comm, kept + new)
        running = self._running_sets() if new else running
        for s in sets:
            s.process_set_id = running[tuple(sorted(s.ranks))]

    def _running_sets(self) -> Dict[Tuple[int, ...], int]:
        """Horovod's process sets as ranks -> id (the global set's id 0 included)."""
        basics = sys.modules[self.hvd.ProcessSet.__module__]._basics  # Horovod's table has no public reader
        return {tuple(ranks): int(k) for k, ranks in basics._get_process_set_ids_and_ranks().items()}

    def is_initialized(self) -> bool:
        """True once Horovod runs."""
        return bool(self.hvd.is_initialized())

    def world_size(self) -> int:
        """Processes in the job: Horovod's size once it runs, the launcher's before (to check arguments first)."""
        return int(self.hvd.size()) if self.hvd.is_initialized() else detect().size

    def rank(self) -> int:
        """This process's rank in the job."""
        self.check_initialized("rank()")
        return int(self.hvd.rank())

    def size(self) -> int:
        """Number of processes in the job."""
        self.check_initialized("size()")
        return int(self.hvd.size())

    def allreduce(self, tensor: T, op: str = "average", name: Optional[str] = None) -> T:
        """Reduce ``tensor`` over all ranks with the core op name (``"average"``, ``"sum"`` ...)."""
        self.check_initialized("allreduce")
        return self.hvd.allreduce(tensor, name=name, op=self.op_of(op))  # type: ignore[no-any-return]

    def broadcast(self, tensor: T, root_rank: int, name: Optional[str] = None) -> T:
        """Return root_rank's ``tensor`` on every rank."""
        self.check_initialized("broadcast")
        return self.hvd.broadcast(tensor, root_rank, name=name)  # type: ignore[no-any-return]

    def allgather(self, tensor: T, name: Optional[str] = None) -> T:
        """Concatenate every rank's ``tensor`` along the first axis."""
        self.check_initialized("allgather")
        return self.hvd.allgather(tensor, name=name)  # type: ignore[no-any-return]

    def allgather_object(self, obj: Any, name: Optional[str] = None) -> List[Any]:
        """Every rank's ``obj`` (picklable), as a list indexed by rank; ``[obj]`` in a one-process job."""
        self.check_initialized("allgather_object")
        if int(self.hvd.size()) == 1:
            return [obj]
        return list(self.hvd.allgather_object(obj, name=name))

    def barrier(self) -> None:
        """Wait until every rank gets here."""
        self.check_initialized("barrier")
        self.hvd.barrier()

    # -- bytes (checkpoint files, RNG states) over Horovod: lengths first, then the bytes -------
    def byte_tensor(self, data: bytes) -> T:
        """A 1-d uint8 tensor of ``data`` (the adapter's)."""
        raise NotImplementedError

    def int64_tensor(self, values: Sequence[int]) -> T:
        """A 1-d int64 tensor of ``values`` (the adapter's)."""
        raise NotImplementedError

    def host_bytes(self, tensor: T) -> bytes:
        """The raw bytes of a tensor on the host (the adapter's)."""
        raise NotImplementedError

    def guard(self, what: str) -> ContextManager[None]:
        """A bound on an eager collective's wait (none by default)."""
        return contextlib.nullcontext()

    def _distributed(self) -> bool:
        return bool(self.hvd.is_initialized()) and int(self.hvd.size()) > 1

    def gather_bytes(self, data: bytes, name: str, process_set: Any = None) -> List[bytes]:
        """Every rank's ``data`` (of ``process_set``, default all), in rank order; ``[data]`` in a one-process job."""
        if not self._distributed():
            return [data]
        group = {} if process_set is None else {"process_set": process_set}
        with self.guard(name):
            lengths = self.hvd.allgather(self.int64_tensor([len(data)]), name=f"{name}.lengths", **group)
            joined = self.hvd.allgather(self.byte_tensor(data), name=f"{name}.bytes", **group)
            return split_gathered(self.host_bytes(joined), _int64s(self.host_bytes(lengths)))

    def broadcast_bytes(self, data: Optional[bytes], root_rank: int, name: str, process_set: Any = None) -> bytes:
        """``root_rank``'s ``data`` on every rank (of ``process_set``, default all; ``b""`` when the root has none)."""
        if not self._distributed():
            return data or b""
        group = {} if process_set is None else {"process_set": process_set}
        with self.guard(name):
            length = self.hvd.broadcast(self.int64_tensor([len(data or b"")]), root_rank, name=f"{name}.length",
                                        **group)
            size = _int64s(self.host_bytes(length))[0]
            if size == 0:
                return b""
            buffer = self.byte_tensor(data if data else bytes(size))
            return self.host_bytes(self.hvd.broadcast(buffer, root_rank, name=f"{name}.bytes", **group))


def _int64s(raw: bytes) -> List[int]:
    # host_bytes of an int64 tensor: native-order 8-byte integers, as numpy lays them out.
    return [int.from_bytes(raw[k:k + 8], sys.byteorder, signed=True) for k in range(0, len(raw), 8)]
