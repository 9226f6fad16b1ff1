"""``dualframe plan`` on real models: an MLP, a CNN and a small Transformer, in torch and in Keras.

Each framework's three models are measured by one probe subprocess (torch on the meta device, Keras
by a traced step); the advisor is then asked about four machines per model: one where the model fits
(-> data parallel), one where only its activations are too big (-> checkpointing or accumulation),
one where it does not fit (-> pipeline) and the same with devices to spare (-> hybrid).
"""
import json
import os
import pathlib
import subprocess
import sys

import pytest

import dualframe
from dualframe.plan import Hardware, ModelSpec, Training, advise, measure, to_json
from dualframe.plan.advisor import PIPELINES
from dualframe.plan.memory import group_memory

ROOT = pathlib.Path(__file__).resolve().parents[3]
MODELS = {
    "torch": [("mlp", (256,), "float32"), ("cnn", (3, 32, 32), "float32"), ("transformer", (64,), "int64")],
    "keras": [("mlp", (256,), "float32"), ("cnn", (32, 32, 3), "float32"), ("transformer", (64,), "int32")],
}
# Parameters, counted by hand from the layer sizes in plan_models: identical in both frameworks.
PARAMETERS = {
    "mlp": 256 * 512 + 512 + 3 * (512 * 512 + 512) + 512 * 10 + 10,
    "cnn": (3 * 9 * 128 + 128) + 2 * 128 + 4 * (128 * 9 * 128 + 128) + 128 * 10 + 10,
    "transformer": 1000 * 128 + 2 * (4 * (128 * 128 + 128) + 2 * 128 * 512 + 512 + 128 + 4 * 128) + 128 * 10 + 10,
}
BATCH = 1024  # activations weigh as much as the weights, even for the MLP
#: Where the weights, not the activations, are the problem: a small batch.
TIGHT_BATCH = 8


@pytest.fixture(scope="module")
def profiles():
    """{framework: {model: profile}}, two probe subprocesses in all."""
    found = {}
    for framework, models in MODELS.items():
        module = f"tests.core.plan.plan_models.{framework}_models"
        specs = [ModelSpec(f"{module}:{name}", shape, dtype) for name, shape, dtype in models]
        measured, devices = measure(specs, cwd=str(ROOT))
        assert devices == []                      # no accelerator on this machine
        found[framework] = {name: p for (name, _, _), p in zip(models, measured)}
    return found


CASES = [(f, m) for f in MODELS for m in PARAMETERS]


@pytest.mark.parametrize("framework, model", CASES)
def test_probe_counts_parameters_and_finds_activations(profiles, framework, model):
    profile = profiles[framework][model]
    assert profile.framework == framework           # detected from what the module imports
    assert profile.parameters == PARAMETERS[model]
    assert all(layer.output > 0 for layer in profile.layers)
    assert sum(layer.activations for layer in profile.layers) > 0


@pytest.mark.parametrize("model", PARAMETERS)
def test_both_frameworks_see_the_same_model(profiles, model):
    torch_profile, keras_profile = profiles["torch"][model], profiles["keras"][model]
    ratio = sum(l.activations for l in keras_profile.layers) / sum(l.activations for l in torch_profile.layers)
    assert 0.5 < ratio < 2, f"{model}: Keras saves {ratio:.2f}x the activations torch saves"
    assert keras_profile.layers[-1].output == torch_profile.layers[-1].output == 10


def _state(profile) -> float:
    memory = group_memory(profile, range(profile.num_layers), Training(TIGHT_BATCH))
    return memory.parameters + memory.gradients + memory.optimizer


def _hardware(usable: float, devices_per_node: int = 4, nodes: int = 1) -> Hardware:
    return Hardware(memory_per_device=usable / 0.9, devices_per_node=devices_per_node, nodes=nodes, kind="gpu")


def _check_arguments(plan) -> None:
    """The printed strategy constructs, and its balance covers the model."""
    strategy = eval(to_json(plan)["recommended"]["strategy"], {"dualframe": dualframe})
    balance = getattr(getattr(strategy, "pipeline", strategy), "balance", None)
    if balance is not None:
        assert sum(balance) == plan.profile.num_layers


@pytest.mark.parametrize("framework, model", CASES)
def test_recommendations_follow_the_memory(profiles, framework, model):
    profile = profiles[framework][model]
    plain = advise(profile, Training(BATCH), _hardware(1e12)).recommended
    assert plain.kind == "data parallel" and plain.replicas == 4
    # Nearly fits: 5% short of plain data parallelism, on 2 devices.
    plain_two = advise(profile, Training(BATCH), _hardware(1e12, 2)).recommended.memory.total
    nearly = advise(profile, Training(BATCH), _hardware(plain_two * 0.95, 2))
    assert nearly.recommended.kind in ("data parallel + checkpointing", "data parallel + accumulation"), nearly.reason
    # Does not fit: the weights, gradients and Adam state alone are 1 / 0.7 of a device.
    tight = advise(profile, Training(TIGHT_BATCH), _hardware(_state(profile) * 0.7))
    assert tight.recommended is not None, tight.reason
    assert tight.recommended.kind in PIPELINES and 2 <= tight.recommended.stages <= 4
    assert tight.recommended.chunks == min(4 * tight.recommended.stages, TIGHT_BATCH)
    # ... and slow: four nodes of four devices.
    wide = advise(profile, Training(TIGHT_BATCH), _hardware(_state(profile) * 0.7, nodes=4))
    hybrid = {o.kind: o for o in wide.options}["hybrid"]
    assert hybrid.fits and hybrid.replicas >= 2
    # Over 16 replicas a torch model's parameters, sharded (ZeRO-3), may fit before a split is needed.
    zero3 = {o.kind: o for o in wide.options}.get("data parallel + sharded parameters")
    assert wide.recommended.kind == ("data parallel + sharded parameters" if zero3 and zero3.fits else "hybrid")
    for plan in (advise(profile, Training(BATCH), _hardware(1e12)), nearly, tight, wide):
        _check_arguments(plan)


def _plan_cli(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "dualframe", "plan", *args], capture_output=True, text=True,
                          cwd=ROOT, env=env, timeout=300)


def test_cli_json_for_a_torch_model():
    result = _plan_cli("tests.core.plan.plan_models.torch_models:transformer", "--input-shape", "64", "--input-dtype",
                       "int64", "--batch-size", "8", "--memory-per-device", "6MiB", "--devices-per-node", "4",
                       "--json")
    assert result.returncode == 0, result.stderr[-3000:]
    plan = json.loads(result.stdout)
    assert plan["model"]["framework"] == "torch" and plan["hardware"]["devices"] == 4
    assert plan["recommended"]["kind"] in PIPELINES, plan["reason"]
    assert plan["recommended"]["strategy"].startswith("dualframe.Pipeline(balance=[")
    assert "devices=['cuda:0', 'cuda:1'" in plan["recommended"]["strategy"]


def test_cli_table_for_a_saved_keras_model(tmp_path):
    saved = tmp_path / "mlp.keras"
    code = f"import sys; sys.path.insert(0, {str(ROOT)!r}); from tests.core.plan.plan_models.keras_models import mlp; mlp().save({str(saved)!r})"
    made = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))
    assert made.returncode == 0, made.stderr[-3000:]
    result = _plan_cli(str(saved), "--input-shape", "256", "--batch-size", "16", "--optimizer", "sgd")
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"model     keras {saved}: 5 layers, 0.92 M parameters (float32)" in result.stdout
    assert "* data parallel " in result.stdout and "strategy = dualframe.DataParallel()" in result.stdout


def test_cli_explains_a_module_that_is_not_there():
    result = _plan_cli("no_such_models:mlp", "--input-shape", "8")
    assert result.returncode == 2
    assert "could not measure no_such_models:mlp: ModuleNotFoundError: No module named 'no_such_models'" in result.stderr
