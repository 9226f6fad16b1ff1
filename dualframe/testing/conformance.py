"""The Backend conformance suite: framework-free checks, with numbers, that any adapter's ``Backend`` passes.

It lives in the package (not under ``tests/``) because it is the ``dualframe.backend`` contract in
executable form: both adapters' tests run it (``tests/torch/test_conformance.py``,
``tests/tensorflow/test_conformance.py``), and a new adapter can run it without our test tree.
It never imports a framework: tensors are made and read through the backend's own ``Wire``.
Every check works for any job size (one process in the unit tests).

An adapter's test file runs it under pytest by subclassing ``ConformanceTests`` (one test per check).

Example:
    >>> from dualframe.torch.backend import BACKEND                  # doctest: +SKIP
    >>> for check in CHECKS: check(BACKEND, "/tmp/conformance")      # doctest: +SKIP
"""
from __future__ import annotations

import copy
import json
import os
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from dualframe.backend import Backend, BatchOps, Collectives, Placement, PlanProbe, TensorCaster
from dualframe.pipeline.layout import DTYPE_NAMES
from dualframe.reliability.stage_checkpoint import load_stage, save_stage

FLOAT32, INT64 = DTYPE_NAMES.index("float32"), DTYPE_NAMES.index("int64")
_NAME = "dualframe.conformance"


def _tensor(backend: "Backend[Any]", values: Sequence[float], code: int = FLOAT32) -> Any:
    return backend.wire(backend.placement.device(None)).tensor(values, code)


def _values(backend: "Backend[Any]", tensor: Any) -> List[Any]:
    return backend.wire(backend.placement.device(None)).values(tensor)


def _expect(what: str, actual: Any, expected: Any) -> None:
    if actual != expected:
        raise AssertionError(f"{what}: expected {expected!r}, got {actual!r}")


def check_parts(backend: "Backend[Any]", directory: str) -> None:
    """The backend and its parts satisfy the protocols of ``dualframe.backend``."""
    for part, protocol in ((backend, Backend), (backend.collectives, Collectives), (backend.caster, TensorCaster),
                           (backend.batches, BatchOps), (backend.placement, Placement)):
        if not isinstance(part, protocol):
            raise AssertionError(f"{type(part).__name__} does not implement {protocol.__name__}")


def check_collectives(backend: "Backend[Any]", directory: str) -> None:
    """allreduce (sum, average, min, max), broadcast, allgather and allgather_object give Horovod's numbers."""
    collectives = backend.collectives
    collectives.init()
    rank, size = collectives.rank(), collectives.size()
    _expect("world_size()", collectives.world_size(), size)
    if not 0 <= rank < size:
        raise AssertionError(f"rank {rank} outside [0, {size})")
    mine = _tensor(backend, [rank + 1.0, 2.0 * (rank + 1), -1.0])
    total = size * (size + 1) / 2
    _expect("allreduce sum", _values(backend, collectives.allreduce(mine, op="sum", name=f"{_NAME}.sum")),
            [total, 2 * total, -float(size)])
    _expect("allreduce average", _values(backend, collectives.allreduce(mine, op="average", name=f"{_NAME}.avg")),
            [total / size, 2 * total / size, -1.0])
    _expect("allreduce min", _values(backend, collectives.allreduce(mine, op="min", name=f"{_NAME}.min"))[0], 1.0)
    _expect("allreduce max", _values(backend, collectives.allreduce(mine, op="max", name=f"{_NAME}.max"))[0],
            float(size))
    _expect("broadcast from 0", _values(backend, collectives.broadcast(mine, 0, name=f"{_NAME}.bcast")),
            [1.0, 2.0, -1.0])
    gathered = _values(backend, collectives.allgather(_tensor(backend, [rank, 10 * rank], INT64), name=f"{_NAME}.ag"))
    _expect("allgather", gathered, [v for r in range(size) for v in (r, 10 * r)])
    objects = collectives.allgather_object({"rank": rank, "square": rank * rank}, name=f"{_NAME}.ago")
    _expect("allgather_object", objects, [{"rank": r, "square": r * r} for r in range(size)])
    collectives.barrier()


def check_caster(backend: "Backend[Any]", directory: str) -> None:
    """dtype names, and casts to float16 and back, keep values float16 holds exactly."""
    caster = backend.caster
    values = [0.5, -2.0, 1024.0, 3.25]
    x = _tensor(backend, values)
    _expect("dtype_name", caster.dtype_name(x), "float32")
    half = caster.cast(x, "float16")
    _expect("dtype_name after cast", caster.dtype_name(half), "float16")
    back = caster.cast(half, "float32")
    _expect("dtype_name after cast back", caster.dtype_name(back), "float32")
    _expect("values after the round trip", _values(backend, back), values)
    _expect("int64 name", caster.dtype_name(_tensor(backend, [1, 2], INT64)), "int64")


def check_batches(backend: "Backend[Any]", directory: str) -> None:
    """split cuts consecutive rows of the given counts; concat joins them back."""
    batch = _tensor(backend, [float(v) for v in range(10)])
    parts = backend.batches.split(batch, [4, 3, 3])
    _expect("split", [_values(backend, p) for p in parts], [[0.0, 1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
    _expect("concat", _values(backend, backend.batches.concat(parts)), [float(v) for v in range(10)])


def check_placement(backend: "Backend[Any]", directory: str) -> None:
    """A stage placed on the CPU (by name, or by default) receives into buffers of the asked shape and dtype."""
    for name in ("cpu", None):
        wire = backend.wire(backend.placement.device(name))
        _expect(f"empty((2, 3)) on {name!r}", wire.describe(wire.empty((2, 3), FLOAT32)), ((2, 3), FLOAT32))


def check_wire(backend: "Backend[Any]", directory: str) -> None:
    """The pipeline wire: tensors of every code, Horovod's asynchronous broadcast and allreduce, bounded waits."""
    collectives = backend.collectives
    collectives.init()
    size = collectives.size()
    everyone = backend.process_sets([])[tuple(range(size))]
    wire = backend.wire(backend.placement.device(None))
    for code, name in enumerate(DTYPE_NAMES):
        values: List[Any] = [True, False] if name == "bool" else [1, 2, 3]
        tensor = wire.tensor(values, code)
        _expect(f"describe({name})", wire.describe(tensor), ((len(values),), code))
        _expect(f"values({name})", [int(v) for v in wire.values(tensor)], values)
    sent = wire.tensor([4.0, 5.0], FLOAT32)
    handle = wire.broadcast(sent, 0, f"{_NAME}.wire.bcast", everyone)
    if not wire.done(handle, 30.0):
        raise AssertionError("a broadcast within the job did not finish in 30 s")
    _expect("wire broadcast", wire.values(wire.result(handle)), [4.0, 5.0])
    handle = wire.allreduce(wire.tensor([1.0, 3.0], FLOAT32), "sum", f"{_NAME}.wire.sum", everyone)
    if not wire.done(handle, 30.0):
        raise AssertionError("an allreduce within the job did not finish in 30 s")
    _expect("wire allreduce sum", wire.values(wire.result(handle)), [float(size), 3.0 * size])
    _expect("stopped(ValueError)", wire.stopped(ValueError("not a transport error")), None)


def check_point_to_point(backend: "Backend[Any]", directory: str) -> None:
    """MPI point-to-point, where the job has it: a message to this rank itself arrives intact."""
    collectives = backend.collectives
    collectives.init()
    device = backend.placement.device(None)
    direct = backend.point_to_point(device, 2, f"{_NAME}.p2p")
    if direct is None:  # Gloo, or no mpi4py: pipelines use Horovod broadcasts (check_wire)
        return
    wire, rank = backend.wire(device), collectives.rank()
    receiving = direct.receive(wire.empty((3,), FLOAT32), rank, 5)
    sending = direct.send(wire.tensor([7.0, 8.0, 9.0], FLOAT32), rank, 5)
    if not (direct.done(sending, 30.0) and direct.done(receiving, 30.0)):
        raise AssertionError("a message to this rank did not arrive in 30 s")
    _expect("point-to-point message", wire.values(direct.result(receiving)), [7.0, 8.0, 9.0])


def check_bytes(backend: "Backend[Any]", directory: str) -> None:
    """Checkpoint bytes: every rank's bytes gathered in rank order, rank 0's broadcast, empty bytes too."""
    collectives = backend.collectives
    collectives.init()
    rank, size = collectives.rank(), collectives.size()
    mine = bytes([rank % 256]) * (rank + 1) + b"\x00\xff"
    _expect("gather_bytes", backend.collectives.gather_bytes(mine, f"{_NAME}.gather"),
            [bytes([r % 256]) * (r + 1) + b"\x00\xff" for r in range(size)])
    sent = b"root\x00bytes" if rank == 0 else None
    _expect("broadcast_bytes", backend.collectives.broadcast_bytes(sent, 0, f"{_NAME}.bcast"), b"root\x00bytes")
    _expect("broadcast_bytes of nothing", backend.collectives.broadcast_bytes(None, 0, f"{_NAME}.none"), b"")


class _Part:
    """One stage per rank, no replicas: this rank's stage of a size-stage pipeline."""

    def __init__(self, rank: int, size: int) -> None:
        self.stage_index, self.stages, self.stage_ranks, self.stage_process_set = rank, size, [rank], None


class _JSONCodec:
    """A stage file of JSON: what the core's procedure needs of a codec, with nothing of a framework."""

    suffix = ".json"

    def __init__(self, weights: List[float], rng: int) -> None:
        self.weights, self.rng = weights, rng

    def rng_bytes(self) -> bytes:
        return json.dumps(self.rng).encode()

    def collect(self) -> None:
        """Nothing to gather: the weights are this process's."""

    def encode(self, header: Dict[str, Any], rngs: List[bytes]) -> bytes:
        return json.dumps({"header": header, "rng": [json.loads(r) for r in rngs], "weights": self.weights}).encode()

    def decode(self, data: bytes, where: str) -> Tuple[Dict[str, Any], List[Any], Any]:
        content = json.loads(data)
        return content["header"], content["rng"], content["weights"]

    def apply(self, content: Any) -> None:
        self.weights = list(content)

    def set_rng(self, state: Any) -> None:
        self.rng = state

    def load_merged(self, path: str) -> Any:
        raise AssertionError(f"{path} is a folder; load_merged must not be called")


def check_stage_checkpoint(backend: "Backend[Any]", directory: str) -> None:
    """The core's stage-checkpoint procedure over this backend: save, then load back the weights, RNG and progress."""
    collectives = backend.collectives
    collectives.init()
    rank, size = collectives.rank(), collectives.size()
    mine = os.fspath(directory).encode() if rank == 0 else None
    root = backend.collectives.broadcast_bytes(mine, 0, f"{_NAME}.dir").decode()  # one folder for every rank
    part = _Part(rank, size)
    saved = _JSONCodec([0.5 * rank, 1.5], rng=40 + rank)
    path = save_stage(backend, saved, root, part, step=3, epoch=1, data_position={"next": 4}, extra={"k": "v"})
    _expect("the written file", path is not None and os.path.isfile(path), True)
    loaded = _JSONCodec([0.0, 0.0], rng=0)
    state = load_stage(backend, loaded, root, part)
    if state is None:
        raise AssertionError("load_stage found no checkpoint after save_stage")
    _expect("progress", (state.step, state.epoch, state.data_position, state.extra), (3, 1, {"next": 4}, {"k": "v"}))
    _expect("weights", loaded.weights, [0.5 * rank, 1.5])
    _expect("RNG state", loaded.rng, 40 + rank)


def check_plan_probe(probe: Any) -> None:
    """An adapter's plan-probe module: the ``PlanProbe`` functions, and devices as the planner's records."""
    if not isinstance(probe, PlanProbe):
        raise AssertionError(f"{getattr(probe, '__name__', probe)!r} does not implement PlanProbe")
    devices = probe.visible_devices()
    for record in devices:
        if not (isinstance(record.get("name"), str) and isinstance(record.get("memory"), int) and record["memory"] > 0):
            raise AssertionError(f"visible_devices() records need a name and a positive memory (record: {record})")


#: Every check of a Backend, in order; each takes (backend, a folder this rank may write).
CHECKS: List[Callable[["Backend[Any]", str], None]] = [
    check_parts, check_collectives, check_caster, check_batches, check_placement, check_wire, check_point_to_point,
    check_bytes, check_stage_checkpoint,
]


def check_backend(backend: "Backend[Any]", directory: str, probe: Optional[Any] = None) -> None:
    """Run every check (and ``check_plan_probe`` when ``probe`` is given); AssertionError names the first failure."""
    for check in CHECKS:
        check(backend, directory)
    if probe is not None:
        check_plan_probe(probe)


class _DoublingBatches:
    """The backend's BatchOps with a wrong ``concat`` (every part twice): a wrong number the suite must catch."""

    def __init__(self, batches: "BatchOps[Any]") -> None:
        self.batches = batches

    def split(self, batch: Any, sizes: Sequence[int]) -> List[Any]:
        return self.batches.split(batch, sizes)

    def concat(self, parts: Sequence[Any]) -> Any:
        return self.batches.concat(list(parts) * 2)


def check_suite_catches_a_wrong_number(backend: "Backend[Any]") -> None:
    """The suite itself fails on ``backend`` with a wrong ``concat``, naming the check and the values."""
    wrong = copy.copy(backend)
    wrong.batches = _DoublingBatches(backend.batches)
    try:
        check_batches(wrong, "")
    except AssertionError as error:
        if "concat: expected [0.0, 1.0" not in str(error):
            raise AssertionError(f"check_batches failed without naming concat and its values: {error}") from None
        return
    raise AssertionError("check_batches passed a backend whose concat returns every part twice")


class ConformanceTests:
    """The suite as pytest tests: an adapter's test file subclasses it as ``Test...``, naming backend and probe.

    pytest collects one ``test_backend_conforms`` per entry of ``CHECKS`` (named after the check), the
    plan probe's check, and the suite's check that it catches a wrong number. pytest is not imported:
    ``pytest_generate_tests`` is pytest's hook by name, which pytest looks up on a test class too.

    Example:
        >>> import dualframe.torch.plan.probe as plan_probe              # doctest: +SKIP
        >>> from dualframe.torch.backend import BACKEND                  # doctest: +SKIP
        >>> class TestTorchBackend(ConformanceTests):                    # doctest: +SKIP
        ...     backend, probe = BACKEND, plan_probe
    """

    backend: Any = None
    probe: Any = None

    def pytest_generate_tests(self, metafunc: Any) -> None:
        if "check" in metafunc.fixturenames:
            metafunc.parametrize("check", CHECKS, ids=[check.__name__ for check in CHECKS])

    def test_backend_conforms(self, check: Callable[["Backend[Any]", str], None], tmp_path: Any) -> None:
        check(self.backend, str(tmp_path))

    def test_plan_probe_conforms(self) -> None:
        check_plan_probe(self.probe)

    def test_a_wrong_number_is_reported(self) -> None:
        check_suite_catches_a_wrong_number(self.backend)
