"""Measuring models in a subprocess, where only the model's own framework is loaded.

``measure`` (in the caller's process, which loads no framework) starts
``python -m dualframe.plan.probe`` and sends it the models to measure as JSON. The child imports the
model's module first and looks at what it loaded: torch -> the torch probe, Keras/TensorFlow -> the
Keras probe. A module that imports neither at the top has its builder called, and what it returns
decides. A saved Keras model (``.keras``/``.h5`` file or SavedModel folder) goes to the Keras probe.
One child measures one framework's models, so torch and TensorFlow never share a process.
"""
from __future__ import annotations

import importlib
import importlib.util
import json
import os
import subprocess
import sys
from dataclasses import asdict, dataclass
from types import ModuleType
from typing import Any, Dict, List, Optional, Sequence, Tuple

from dualframe.errors import DualframeError
from dualframe.plan.profile import ModelProfile

#: Probe module of each framework, imported in the child only.
PROBES = {"torch": "dualframe.torch.plan.probe", "keras": "dualframe.tensorflow.plan.probe"}
FRAMEWORKS = ("auto",) + tuple(PROBES)
_ROOTS = {"torch": "torch", "keras": "keras", "tensorflow": "keras"}
#: Libraries whose models are one framework's: loading them says which probe builds the model.
_LIBRARIES = {"transformers": "torch", "timm": "torch", "torchvision": "torch", "keras_hub": "keras",
              "keras_nlp": "keras", "keras_cv": "keras"}


class ProbeError(DualframeError, RuntimeError):
    """A model could not be loaded or measured; the message says which and why."""


@dataclass(frozen=True)
class ModelSpec:
    """What to measure: a builder (``module:function`` or ``path/file.py:function``) or a saved Keras model.

    Example:
        >>> spec = ModelSpec("my_models:resnet", input_shape=(3, 224, 224))
        >>> spec.framework
        'auto'
    """

    source: str
    input_shape: Tuple[int, ...]
    input_dtype: str = "float32"
    framework: str = "auto"
    input_names: Tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.framework not in FRAMEWORKS:
            raise ProbeError(f"unknown framework {self.framework!r}; choose one of {', '.join(FRAMEWORKS)}")
        shape = tuple(self.input_shape)
        if not shape or any(isinstance(d, bool) or not isinstance(d, int) or d < 1 for d in shape):
            raise ProbeError(f"input shape must be one or more ints >= 1, without the batch (input_shape: {shape})")
        object.__setattr__(self, "input_shape", shape)
        names = tuple(self.input_names)
        if any(not isinstance(n, str) or not n.isidentifier() for n in names) or len(set(names)) < len(names):
            raise ProbeError(f"input names are distinct identifiers, e.g. input_ids,attention_mask "
                             f"(input_names: {list(names)})")
        object.__setattr__(self, "input_names", names)
        if not is_saved_model(self.source) and ":" not in self.source:
            raise ProbeError(f"a model is 'module:function', 'file.py:function' or a saved Keras model "
                             f"(.keras, .h5, SavedModel folder) (model: {self.source!r})")


def is_saved_model(source: str) -> bool:
    """True for a saved Keras model: a .keras/.h5 file or a SavedModel folder."""
    return source.endswith((".keras", ".h5")) or os.path.isfile(os.path.join(source, "saved_model.pb"))


def measure(specs: Sequence[ModelSpec], python: Optional[str] = None, timeout: float = 600,
            cwd: Optional[str] = None) -> Tuple[List[ModelProfile], List[Dict[str, Any]]]:
    """Measure ``specs`` (all of one framework) in one child process.

    Returns:
        The profiles, in order, and the accelerators the child's framework sees ([{"name", "memory"}]).

    Raises:
        ProbeError: the child failed; its message (import error, wrong framework ...) is included.
    """
    request = json.dumps({"models": [asdict(spec) for spec in specs]})
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL=os.environ.get("TF_CPP_MIN_LOG_LEVEL", "3"))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (os.getcwd() if cwd is None else cwd, env.get("PYTHONPATH")) if p)
    try:
        result = subprocess.run([python or sys.executable, "-m", "dualframe.plan.probe"], input=request,
                                capture_output=True, text=True, timeout=timeout, cwd=cwd, env=env)
    except subprocess.TimeoutExpired:
        raise ProbeError(f"measuring {[s.source for s in specs]} took over {timeout:.0f} s") from None
    lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
    reply = json.loads(lines[-1]) if lines else {}
    if result.returncode != 0 or "profiles" not in reply:
        detail = reply.get("error") or (result.stderr.strip().splitlines() or [f"exit {result.returncode}"])[-1]
        raise ProbeError(f"could not measure {', '.join(s.source for s in specs)}: {detail}")
    return [ModelProfile.from_dict(p) for p in reply["profiles"]], reply["devices"]


# ---- the child: runs as ``python -m dualframe.plan.probe`` ----

def _module(path: str) -> ModuleType:
    if path.endswith(".py") or os.sep in path:
        name = os.path.splitext(os.path.basename(path))[0]
        spec = importlib.util.spec_from_file_location(name, path)
        if spec is None or spec.loader is None:
            raise ProbeError(f"cannot load {path!r} as a Python file")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        return module
    return importlib.import_module(path)


def _loaded() -> set:
    known = {**_ROOTS, **_LIBRARIES}
    return {known[name] for name in known if name in sys.modules}


def framework_of(model: Any) -> Optional[str]:
    """``"torch"`` or ``"keras"`` by the classes ``model`` is an instance of (a transformers model is a torch one)."""
    for cls in type(model).__mro__:
        root = cls.__module__.split(".")[0]
        if root in _ROOTS:
            return _ROOTS[root]
    return None


def _target(spec: ModelSpec) -> Tuple[str, Any]:
    """(framework, what to hand its probe): a builder, a built model or a saved model's path."""
    if is_saved_model(spec.source):
        return "keras", spec.source
    path, _, function = spec.source.rpartition(":")
    builder = getattr(_module(path), function, None)
    if not callable(builder):
        raise ProbeError(f"{path!r} has no function {function!r}")
    if spec.framework != "auto":
        return spec.framework, builder
    loaded = _loaded()
    if len(loaded) == 1:
        return loaded.pop(), builder
    model = _build(builder, loaded)  # loads its framework lazily, or the file loads both: what it returns decides
    framework = framework_of(model)
    if framework is None:
        raise ProbeError(f"{spec.source} returned a {type(model).__module__}.{type(model).__name__}, "
                         "not a torch.nn.Module or a keras.Model")
    return framework, model


def _build(builder: Any, loaded: set) -> Any:
    """Call ``builder``; on torch's ``meta`` device when torch is installed and Keras not loaded (no weights allocated)."""
    if "keras" in loaded or importlib.util.find_spec("torch") is None:
        return builder()
    return importlib.import_module(PROBES["torch"]).build_on_meta(builder)


def _measure_one(spec: ModelSpec, used: List[str]) -> Dict[str, Any]:
    framework, target = _target(spec)
    if used and used[0] != framework:
        raise ProbeError(f"one probe measures one framework ({used[0]} already, {spec.source} is {framework})")
    used.append(framework)
    probe = importlib.import_module(PROBES[framework])
    profile = probe.profile(target, spec.input_shape, spec.input_dtype, spec.source, spec.input_names)
    if profile is None:
        raise ProbeError(f"{spec.source} did not give a {framework} model")
    return dict(profile.to_dict())


def main() -> int:
    """Child entry point: read the request on stdin, print one JSON line, exit 0 (or 2 on error)."""
    try:
        request = json.loads(sys.stdin.read())
        used: List[str] = []
        specs = [ModelSpec(m["source"], tuple(m["input_shape"]), m["input_dtype"], m["framework"],
                           tuple(m.get("input_names", ())))
                 for m in request["models"]]
        profiles = [_measure_one(spec, used) for spec in specs]
        devices = importlib.import_module(PROBES[used[0]]).visible_devices() if used else []
    except Exception as error:  # the parent shows it; a traceback goes to stderr for debugging
        import traceback

        traceback.print_exc()
        print(json.dumps({"error": f"{type(error).__name__}: {error}"}), flush=True)
        return 2
    print(json.dumps({"profiles": profiles, "devices": devices}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
