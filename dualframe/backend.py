"""The one protocol each framework adapter implements: every seam the core crosses into a framework, declared here.

An adapter exposes one ``Backend`` object (``dualframe.torch.backend.BACKEND``,
``dualframe.tensorflow.backend.BACKEND``) composing the parts below; core procedures (the
process pipeline's opening, stage checkpoints) take it as a parameter. ``dualframe.testing.conformance``
checks any backend against these declarations with numbers, so the two adapters cannot drift.

The seams, by who crosses them:

* ``Collectives``: Horovod on the framework's tensors, and bytes over it for checkpoint files
  (``dualframe.collectives`` writes it once).
* ``TensorCaster``: dtype names and casts (fp16 compression, ``dualframe.dp.compression``).
* ``BatchOps``: cutting a batch into micro-batches and joining outputs (process pipelines).
* ``Placement``: the framework's device for a stage (process pipelines).
* ``Wire``, ``Waiter``, ``PointToPoint``: a pipeline link's messages (``dualframe.pipeline.link``).
* a stage's forward and backward on one micro-batch: ``dualframe.pipeline.graph_walk.GraphStageWork``.
* ``StageCodec``: a stage checkpoint's file format (``dualframe.reliability.stage_checkpoint``).
* ``PlanProbe``: measuring a model for the planner (``dualframe.plan.probe``).
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Generic, List, Optional, Protocol, Sequence, Tuple, TypeVar, runtime_checkable

T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)

#: A message's dims and dtype code (an index in ``dualframe.pipeline.layout.DTYPE_NAMES``).
Shape = Tuple[Tuple[int, ...], int]


@runtime_checkable
class Collectives(Protocol[T]):
    """Horovod-backed collectives on one framework's tensors.

    Example:
        >>> from dualframe.torch import collectives       # doctest: +SKIP
        >>> collectives.init()                            # doctest: +SKIP
        >>> collectives.allreduce(torch.ones(3), op="sum")  # doctest: +SKIP
    """

    def init(self, comm: Any = None, process_sets: Any = None) -> None:
        """Start Horovod once (Horovod's order); ``process_sets``: rank lists, ProcessSet objects or "dynamic"."""

    def is_initialized(self) -> bool:
        """True once ``init`` has run."""

    def world_size(self) -> int:
        """Processes in the job, before ``init`` too (from the launcher's variables)."""

    def rank(self) -> int:
        """This process's rank in the job."""

    def size(self) -> int:
        """Number of processes in the job."""

    def allreduce(self, tensor: T, op: str = "average", name: Optional[str] = None) -> T:
        """Reduce ``tensor`` over all ranks with the core op name (``"average"``, ``"sum"`` ...)."""

    def broadcast(self, tensor: T, root_rank: int, name: Optional[str] = None) -> T:
        """Return root_rank's ``tensor`` on every rank."""

    def allgather(self, tensor: T, name: Optional[str] = None) -> T:
        """Concatenate every rank's ``tensor`` along the first axis."""

    def allgather_object(self, obj: Any, name: Optional[str] = None) -> List[Any]:
        """Every rank's picklable ``obj``, as a list indexed by rank."""

    def barrier(self) -> None:
        """Wait until every rank gets here."""

    def gather_bytes(self, data: bytes, name: str, process_set: Any = None) -> List[bytes]:
        """Every rank's ``data`` (of ``process_set``, default all) in rank order; ``[data]`` in a one-process job."""

    def broadcast_bytes(self, data: Optional[bytes], root_rank: int, name: str, process_set: Any = None) -> bytes:
        """``root_rank``'s ``data`` on every rank (of ``process_set``); ``b""`` when the root has none."""


@runtime_checkable
class TensorCaster(Protocol[T]):
    """The two primitives shared behaviours (fp16 compression) need from a framework."""

    def dtype_name(self, tensor: T) -> str:
        """The dtype's short name: ``"float32"``, ``"float16"``, ``"int64"`` ..."""

    def cast(self, tensor: T, dtype_name: str) -> T:
        """``tensor`` converted to the dtype with that short name."""


@runtime_checkable
class BatchOps(Protocol[T]):
    """Cutting a batch into micro-batches and joining them back, along the first axis."""

    def split(self, batch: T, sizes: Sequence[int]) -> List[T]:
        """Split ``batch`` into consecutive pieces of the given row counts."""

    def concat(self, parts: Sequence[T]) -> T:
        """Join pieces back along the first axis."""


@runtime_checkable
class Placement(Protocol):
    """The framework's device for a pipeline stage, from the stage's device name."""

    def device(self, name: Optional[str]) -> Any:
        """What the framework places a stage with for device ``name`` (None: the framework's default)."""


class Waiter(Protocol[T_co]):
    """What ``wait_for`` needs of a transport: wait for an operation, read its result, explain a failure."""

    def done(self, handle: Any, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the operation; whether it finished."""

    def result(self, handle: Any) -> T_co:
        """The finished operation's tensor (raises what the operation raised)."""

    def stopped(self, error: BaseException) -> Optional[str]:
        """A one-line reason when ``error`` means the transport stopped (a peer failed); None otherwise."""


class Wire(Waiter[T], Protocol[T]):
    """The framework's calls a link needs: tensors, Horovod's asynchronous broadcast and allreduce, and waiting."""

    def tensor(self, values: Sequence[float], code: int) -> T:
        """A 1-d tensor of ``values`` with the dtype of code ``code`` (on the host)."""

    def empty(self, shape: Tuple[int, ...], code: int) -> T:
        """A buffer of ``shape`` to receive into (on the stage's device)."""

    def describe(self, tensor: T) -> Shape:
        """The tensor's dims and dtype code; StrategyError for a dtype a message cannot carry."""

    def values(self, tensor: T) -> List[Any]:
        """The tensor's elements as Python numbers (flattened)."""

    def broadcast(self, tensor: T, root_rank: int, name: str, process_set: Any) -> Any:
        """Start Horovod's broadcast of ``tensor`` from ``root_rank`` in ``process_set``; return a handle."""

    def allreduce(self, tensor: T, op: str, name: str, process_set: Any) -> Any:
        """Start Horovod's allreduce (``op``: ``"sum"`` or ``"average"``) in ``process_set``; return a handle."""


class PointToPoint(Waiter[T], Protocol[T]):
    """Direct messages between two ranks (MPI's or ZeroMQ's nonblocking send and receive), numbered by ``message_tag``."""

    #: The transport's name in ``DUALFRAME_PIPELINE_TRANSPORT`` ("mpi", "zmq").
    name: str

    def send(self, tensor: T, dest: int, tag: int) -> Any:
        """Start sending ``tensor`` to rank ``dest``; return a handle (the tensor must stay alive until done)."""

    def receive(self, buffer: T, source: int, tag: int) -> Any:
        """Start receiving into ``buffer`` from rank ``source``; return a handle whose result is the buffer."""


class StagePart(Protocol):
    """What a stage checkpoint reads of a process pipeline (both adapters' ``DistributedPipeline``)."""

    @property
    def stage_index(self) -> int:
        """j: the stage this rank holds."""

    @property
    def stages(self) -> int:
        """n: stages per pipeline."""

    @property
    def stage_ranks(self) -> List[int]:
        """The ranks holding this stage (one per replica), the first of which writes its file."""

    @property
    def stage_process_set(self) -> Any:
        """The Horovod process set of the stage's replicas (None with a single replica)."""


class StageCodec(Protocol):
    """A stage checkpoint's file format, for one pipeline stage (and its optimizer): the adapter's part.

    The procedure (folders, the agreed step, who writes, RNG gathering, barriers) is the core's
    ``dualframe.reliability.stage_checkpoint.save_stage`` / ``load_stage``.
    """

    suffix: str

    def rng_bytes(self) -> bytes:
        """This process's RNG states, serialised (gathered over the stage's replicas)."""

    def collect(self) -> None:
        """Take the stage's state now, on every rank (a stage sharded among its replicas gathers it: a collective)."""

    def encode(self, header: Dict[str, Any], rngs: List[bytes]) -> bytes:
        """The stage's file: its tensors, ``header`` (step, epoch, data_position, extra, stage, stages), ``rngs``."""

    def decode(self, data: bytes, where: str) -> Tuple[Dict[str, Any], List[Any], Any]:
        """(header, RNG states by stage rank, content) of a stage file; CheckpointError naming ``where``."""

    def apply(self, content: Any) -> None:
        """Load the decoded ``content`` into the stage (and its optimizer)."""

    def set_rng(self, state: Any) -> None:
        """Restore one of the RNG states ``decode`` returned."""

    def load_merged(self, path: str) -> Any:
        """Load this stage's part of the merged full-model file ``path``; return its TrainingState."""


@runtime_checkable
class PlanProbe(Protocol):
    """The planner's measuring of one framework's model (``dualframe.torch.plan.probe`` / ``tensorflow.plan.probe``)."""

    def profile(self, target: Any, input_shape: Tuple[int, ...], input_dtype: str, source: str,
                input_names: Tuple[str, ...] = ()) -> Any:
        """The ModelProfile of ``target`` (a builder, a model or a saved model's path); None if not this framework's.

        ``input_names``: keyword inputs, each of ``input_shape`` (empty: as the model's signature implies).
        """

    def visible_devices(self) -> List[Dict[str, Any]]:
        """The devices this process can see, as the planner's hardware records."""


@runtime_checkable
class Backend(Protocol[T]):
    """One framework, as the core uses it: the object each adapter exposes as ``BACKEND``.

    Example:
        >>> from dualframe.torch.backend import BACKEND                  # doctest: +SKIP
        >>> from dualframe.testing.conformance import check_backend      # doctest: +SKIP
        >>> check_backend(BACKEND)                                       # doctest: +SKIP
    """

    name: str
    collectives: Collectives[T]
    caster: TensorCaster[T]
    batches: BatchOps[T]
    placement: Placement
    #: Whether the adapter's process pipelines run a split backward (``W`` actions: ``graph_walk.SplitGraphStageWork``).
    split_backward: bool

    def wire(self, device: Any) -> Wire[T]:
        """The pipeline wire whose receive buffers live on ``device`` (a ``placement.device``)."""

    def point_to_point(self, device: Any, chunks: int, name: str,
                       transport: Optional[str] = None) -> Optional[PointToPoint[T]]:
        """The point-to-point transport every rank agreed on (``transport``: the pipeline's argument), else None (a collective)."""

    def process_sets(self, needed: Sequence[Sequence[int]]) -> Dict[Tuple[int, ...], Any]:
        """Horovod process sets for the rank groups ``needed`` (and the global one), by sorted ranks."""


class AdapterBackend(Generic[T]):
    """A ``Backend`` composed of an adapter's parts: what each adapter's ``BACKEND`` is, written once.

    Args:
        name: the framework (``"torch"``, ``"tensorflow"``).
        collectives, caster, batches, placement: the adapter's implementations of those protocols.
        wire: makes the pipeline ``Wire`` for a device; ``point_to_point``, ``process_sets``: the
            adapter's functions behind those members.
        split_backward: the adapter's stage work runs zero-bubble schedules' ``W`` (``SplitGraphStageWork``);
            False: ``open_stage`` refuses such a schedule before any communication.

    Example:
        >>> BACKEND = AdapterBackend("torch", collectives, TorchCaster(), TorchBatchOps(), TorchPlacement(),
        ...                          TorchWire, point_to_point, process_sets)  # doctest: +SKIP
    """

    def __init__(self, name: str, collectives: Collectives[T], caster: TensorCaster[T], batches: BatchOps[T],
                 placement: Placement, wire: Callable[[Any], Wire[T]],
                 point_to_point: Callable[[Any, int, str, Optional[str]], Optional[PointToPoint[T]]],
                 process_sets: Callable[[Sequence[Sequence[int]]], Dict[Tuple[int, ...], Any]], *,
                 split_backward: bool = False) -> None:
        self.name, self.collectives, self.caster, self.batches, self.placement = (
            name, collectives, caster, batches, placement)
        self.split_backward = split_backward
        self._wire, self._point_to_point, self._process_sets = wire, point_to_point, process_sets

    def wire(self, device: Any) -> Wire[T]:
        """The pipeline wire whose receive buffers live on ``device``."""
        return self._wire(device)

    def point_to_point(self, device: Any, chunks: int, name: str,
                       transport: Optional[str] = None) -> Optional[PointToPoint[T]]:
        """The point-to-point transport every rank agreed on, else None (a collective over every rank)."""
        return self._point_to_point(device, chunks, name, transport)

    def process_sets(self, needed: Sequence[Sequence[int]]) -> Dict[Tuple[int, ...], Any]:
        """Horovod process sets for ``needed`` (and the global one), by sorted ranks."""
        return self._process_sets(needed)
