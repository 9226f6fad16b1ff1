"""Model profiles: per-node parameter counts, per-sample activation sizes and the values between nodes.

A model is a list of nodes in execution order (a Sequential's layers, or a graph's layers/submodules)
and the values (tensors) that flow between them. A value is *live across cut c* (the point where
node c begins) when it is made before c and read at or after c: those values are what a stage that
begins at c receives, and what a checkpointed segment that begins there keeps. A profile without
values is a chain: each node reads only the previous node's output.

A framework probe (``dualframe.torch.plan.probe``, ``dualframe.tensorflow.plan.probe``) measures a
model once and hands the core this description; all memory arithmetic works on it, so the two
frameworks are planned by the same code.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Mapping, Sequence, Tuple

from dualframe.errors import StrategyError

#: Bytes per element of the dtypes the planner knows.
DTYPE_BYTES = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2}


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of ``dtype``; raise StrategyError naming the known dtypes otherwise."""
    if dtype not in DTYPE_BYTES:
        raise StrategyError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPE_BYTES)}")
    return DTYPE_BYTES[dtype]


@dataclass(frozen=True)
class LayerProfile:
    """One node (the unit a ``balance`` counts) as the probe measured it.

    Activation figures are float elements per sample (per row of the batch): the planner multiplies
    them by the batch or micro-batch size and the activation dtype's size.

    Example:
        >>> layer = LayerProfile("fc1", parameters=1056, activations=96.0, output=32.0, largest=32.0)
        >>> layer.parameters
        1056

    Attributes:
        name: the layer's name in the model.
        parameters: trainable parameters (each gets a gradient and optimizer state).
        frozen: non-trainable elements held with the layer (frozen weights, BatchNorm statistics).
        activations: elements saved for the backward pass while the layer runs forward.
        output: elements of the layer's output, what crosses to the next stage.
        largest: elements of the largest single tensor the layer saves or outputs.
        split_point: the name that says "a stage begins here" (torch: the outermost submodule that
            begins with this node, e.g. ``"layer3"`` for ``"layer3.0"``); empty means ``name``.
    """

    name: str
    parameters: int
    frozen: int = 0
    activations: float = 0.0
    output: float = 0.0
    largest: float = 0.0
    split_point: str = ""

    def __post_init__(self) -> None:
        for key in ("parameters", "frozen", "activations", "output", "largest"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise StrategyError(f"layer {self.name!r}: {key} must be a number >= 0 ({key}: {value!r})")
        if not self.split_point:
            object.__setattr__(self, "split_point", self.name)


@dataclass(frozen=True)
class Value:
    """A tensor of the forward pass that leaves the node making it: who makes it, who reads it last.

    Example:
        >>> skip = Value(producer=0, last_reader=3, elements=4096.0)   # node 0's output, read by node 3
        >>> [c for c in range(5) if skip.live_across(c)]
        [1, 2, 3]

    Attributes:
        producer: index of the node that makes it; -1 for the model's input.
        last_reader: index of the last node that reads it (the number of nodes for a model output).
        elements: float elements per sample (non-float tensors by their bytes in float32 units).
    """

    producer: int
    last_reader: int
    elements: float

    def __post_init__(self) -> None:
        if not -1 <= self.producer < self.last_reader or self.elements < 0:
            raise StrategyError(f"a value is made before it is last read and has elements >= 0 (producer: "
                                f"{self.producer}, last_reader: {self.last_reader}, elements: {self.elements})")

    def live_across(self, cut: int) -> bool:
        """True when the value must be held by whoever runs node ``cut`` onwards."""
        return self.producer < cut <= self.last_reader


@dataclass(frozen=True)
class Shared:
    """A trainable parameter several nodes read (a tied embedding and output head): counted once.

    The first reader's ``LayerProfile.parameters`` counts it; a device holding other readers but
    not the first holds a copy too (a split keeps one on every stage that reads it).

    Example:
        >>> Shared(elements=51_470_336, readers=(0, 23)).readers
        (0, 23)
    """

    elements: int
    readers: Tuple[int, ...]

    def __post_init__(self) -> None:
        readers = tuple(sorted(set(int(r) for r in self.readers)))
        if len(readers) < 2 or readers[0] < 0 or self.elements < 0:
            raise StrategyError(f"a shared parameter has elements >= 0 and two or more readers >= 0 "
                                f"(elements: {self.elements}, readers: {list(self.readers)})")
        object.__setattr__(self, "readers", readers)

    def copied_into(self, a: int, b: int) -> bool:
        """True when nodes a..b-1 read it but its first reader (which counts it) is not among them."""
        return not a <= self.readers[0] < b and any(a <= r < b for r in self.readers)


@dataclass(frozen=True)
class ModelProfile:
    """A whole model: its layers in order, the input it was measured with, and where it came from.

    Example:
        >>> profile = ModelProfile("torch", "models:mlp", (16,), [LayerProfile("fc", 272, output=16.0)])
        >>> profile.parameters, profile.num_layers
        (272, 1)
    """

    framework: str
    source: str
    input_shape: Tuple[int, ...]
    layers: Sequence[LayerProfile]
    input_elements: float = 0.0
    dtype: str = "float32"
    notes: Sequence[str] = field(default_factory=tuple)
    values: Sequence[Value] = field(default_factory=tuple)
    shared: Sequence[Shared] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        object.__setattr__(self, "shared", tuple(self.shared))
        if any(s.readers[-1] >= len(self.layers) for s in self.shared):
            raise StrategyError(f"a shared parameter is read by a node past the last of {len(self.layers)}")
        if not self.layers:
            raise StrategyError(f"the model from {self.source!r} has no layers to plan with")
        dtype_bytes(self.dtype)
        object.__setattr__(self, "input_shape", tuple(int(d) for d in self.input_shape))
        object.__setattr__(self, "layers", tuple(self.layers))
        object.__setattr__(self, "notes", tuple(self.notes))
        object.__setattr__(self, "values", tuple(self.values))
        for value in self.values:
            if value.last_reader > len(self.layers):
                raise StrategyError(f"a value is read by node {value.last_reader}, past the last of "
                                    f"{len(self.layers)} nodes")

    @property
    def is_graph(self) -> bool:
        """True when the probe recorded the values between nodes (else the model is a chain)."""
        return bool(self.values)

    def flow(self) -> Tuple[Value, ...]:
        """The values between nodes: the recorded ones, or a chain's (each output read by the next node)."""
        if self.values:
            return tuple(self.values)
        count = len(self.layers)
        return (Value(-1, 0, self.input_elements),) + tuple(
            Value(j, j + 1, layer.output) for j, layer in enumerate(self.layers) if j + 1 < count)

    def live(self) -> List[float]:
        """Per-sample elements live across each cut ``c`` in ``0..num_layers`` (cut 0: the model's input).

        Example:
            >>> skip = ModelProfile("torch", "g", (4,), [LayerProfile(n, 0) for n in "abc"], 4.0,
            ...                     values=[Value(-1, 0, 4.0), Value(0, 2, 8.0), Value(1, 2, 2.0)])
            >>> skip.live()
            [4.0, 8.0, 10.0, 0.0]
        """
        totals = [0.0] * (len(self.layers) + 2)
        for value in self.flow():     # + elements on (producer, last_reader]: a difference array
            totals[value.producer + 1] += value.elements
            totals[value.last_reader + 1] -= value.elements
        running, live = 0.0, []
        for cut in range(len(self.layers) + 1):
            running += totals[cut]
            live.append(running)
        return live

    def split_points(self, starts: Sequence[int]) -> List[str]:
        """The names of the nodes at which stages (or segments) begin, the first stage's left out."""
        return [self.layers[j].split_point for j in starts if j > 0]

    @property
    def num_layers(self) -> int:
        """Number of top-level layers (what a ``balance`` must sum to)."""
        return len(self.layers)

    @property
    def parameters(self) -> int:
        """Trainable parameters of the whole model."""
        return sum(layer.parameters for layer in self.layers)

    def copies(self, a: int, b: int) -> int:
        """Trainable elements of shared parameters nodes a..b-1 hold a copy of (not counted by their layers)."""
        return sum(s.elements for s in self.shared if s.copied_into(a, b))

    def layer_inputs(self) -> List[float]:
        """Per-sample elements entering each layer: the model input, then each layer's output."""
        return [self.input_elements] + [layer.output for layer in self.layers[:-1]]

    def to_dict(self) -> Dict[str, Any]:
        """Plain data for JSON."""
        data = asdict(self)
        data["input_shape"] = list(self.input_shape)
        data["layers"] = [asdict(layer) for layer in self.layers]
        data["notes"] = list(self.notes)
        data["values"] = [[v.producer, v.last_reader, v.elements] for v in self.values]
        data["shared"] = [[s.elements, list(s.readers)] for s in self.shared]
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "ModelProfile":
        """Rebuild a profile from ``to_dict`` output (what a probe prints)."""
        try:
            layers = [LayerProfile(**layer) for layer in data["layers"]]
            return cls(data["framework"], data["source"], tuple(data["input_shape"]), layers,
                       float(data.get("input_elements", 0.0)), data.get("dtype", "float32"),
                       tuple(data.get("notes", ())), [Value(int(p), int(r), float(e)) for p, r, e in data.get("values", ())],
                       [Shared(int(e), tuple(r)) for e, r in data.get("shared", ())])
        except (KeyError, TypeError) as error:
            raise StrategyError(f"not a model profile ({error}); keys: {sorted(data)}") from None
