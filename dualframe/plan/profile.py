"""Model profiles: per-layer parameter counts and per-sample activation sizes, as plain data.

A framework probe (``dualframe.torch.plan_probe``, ``dualframe.tensorflow.plan_probe``) measures a
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
    """One top-level layer (the unit a ``balance`` counts) as the probe measured it.

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
    """

    name: str
    parameters: int
    frozen: int = 0
    activations: float = 0.0
    output: float = 0.0
    largest: float = 0.0

    def __post_init__(self) -> None:
        for key in ("parameters", "frozen", "activations", "output", "largest"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise StrategyError(f"layer {self.name!r}: {key} must be a number >= 0 ({key}: {value!r})")


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

    def __post_init__(self) -> None:
        if not self.layers:
            raise StrategyError(f"the model from {self.source!r} has no layers to plan with")
        dtype_bytes(self.dtype)
        object.__setattr__(self, "input_shape", tuple(int(d) for d in self.input_shape))
        object.__setattr__(self, "layers", tuple(self.layers))
        object.__setattr__(self, "notes", tuple(self.notes))

    @property
    def num_layers(self) -> int:
        """Number of top-level layers (what a ``balance`` must sum to)."""
        return len(self.layers)

    @property
    def parameters(self) -> int:
        """Trainable parameters of the whole model."""
        return sum(layer.parameters for layer in self.layers)

    def layer_inputs(self) -> List[float]:
        """Per-sample elements entering each layer: the model input, then each layer's output."""
        return [self.input_elements] + [layer.output for layer in self.layers[:-1]]

    def to_dict(self) -> Dict[str, Any]:
        """Plain data for JSON."""
        data = asdict(self)
        data["input_shape"] = list(self.input_shape)
        data["layers"] = [asdict(layer) for layer in self.layers]
        data["notes"] = list(self.notes)
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "ModelProfile":
        """Rebuild a profile from ``to_dict`` output (what a probe prints)."""
        try:
            layers = [LayerProfile(**layer) for layer in data["layers"]]
            return cls(data["framework"], data["source"], tuple(data["input_shape"]), layers,
                       float(data.get("input_elements", 0.0)), data.get("dtype", "float32"),
                       tuple(data.get("notes", ())))
        except (KeyError, TypeError) as error:
            raise StrategyError(f"not a model profile ({error}); keys: {sorted(data)}") from None
