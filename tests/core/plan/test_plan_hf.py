"""``dualframe plan`` on transformers and keras_hub models: found by what they are, counted once, cut between blocks.

The GPT-2-medium-shaped ``GPT2LMHeadModel`` (24 blocks, width 1024) is probed on torch's ``meta``
device (nothing allocated); the keras_hub backbone (Keras builds its weights) is a 12-layer one.
Estimates are checked against MEASURED peaks of real training steps on this CPU, as
test_plan_memory.py does (resident-set high-water mark minus the resident set before the model is
built), within 15 %: a small GPT2LMHeadModel trained on its loss (labels = the token ids; plain and
with blocks 0-2 checkpointed) and a small keras_hub GPT2Backbone trained on the mean of its output
at batch 32 (TF's traced graphs add a constant ~100 MiB of host memory on the CPU, which a smaller
batch would make the larger part).
"""
import json
import os
import pathlib
import subprocess
import sys

import pytest

from dualframe.plan import Hardware, ModelSpec, Training, group_memory, measure
from dualframe.plan.advisor import options
from dualframe.plan.probe import ProbeError
from dualframe.plan.profile import Shared

ROOT = pathlib.Path(__file__).resolve().parents[3]
MODELS = "tests/core/plan/plan_models/hf_models.py"
TOLERANCE = 0.15
# The setting: batch 8 x 512 tokens, AdamW, 2 nodes x 4 GPUs of 16 GB.
HARDWARE = Hardware(16e9, devices_per_node=4, nodes=2, kind="gpu")
TRAINING = Training(8, "adamw")
LABELS = ("input_ids", "attention_mask", "labels")


@pytest.fixture(scope="module")
def gpt2():
    (profile,), _ = measure([ModelSpec(f"{MODELS}:gpt2_medium", (512,), "int64")], cwd=str(ROOT))
    return profile


@pytest.fixture(scope="module")
def backbone():
    (profile,), _ = measure([ModelSpec(f"{MODELS}:gpt2_backbone_12", (512,), "int32")], cwd=str(ROOT))
    return profile


def _rows(profile):
    return {option.kind: option for option in options(profile, TRAINING, HARDWARE)}


def _stage_parameters(profile, starts):
    ends = list(starts[1:]) + [profile.num_layers]
    return [group_memory(profile, range(a, b), TRAINING).parameters / 4 for a, b in zip(starts, ends)]


def _check_rows(profile, block):
    rows = _rows(profile)
    plain, checkpointing = rows["data parallel"], rows["data parallel + checkpointing"]
    assert checkpointing.memory.total < 0.4 * plain.memory.total, (checkpointing.memory, plain.memory)
    assert checkpointing.memory.activations < 0.15 * plain.memory.activations
    assert all(point.startswith(block) for point in checkpointing.split_points)
    splits = [o for o in rows.values() if o.stages > 1]
    assert any(o.kind.startswith("pipeline") for o in splits)
    for option in splits:
        assert all(point.startswith(block) for point in option.split_points), option
        if option.kind.startswith("model split"):
            continue   # one stage runs at a time: balanced by memory, not parameters (cuts.stage_starts)
        starts = [0] + [int(point[len(block):]) for point in option.split_points]
        sizes = _stage_parameters(profile, starts)
        assert max(sizes) <= 1.1 * min(sizes), (option.kind, option.split_points, sizes)
    return rows


def test_gpt2_medium_is_torch_counted_once_and_cut_between_blocks(gpt2):
    assert gpt2.framework == "torch"          # found without --framework: the file loads neither at the top
    assert gpt2.parameters == 354_823_168     # lm_head's weight is wte's: counted once
    assert [layer.name for layer in gpt2.layers] == [f"transformer.h.{j}" for j in range(24)]
    assert gpt2.shared == (Shared(50257 * 1024, (0, 23)),)   # read by the first and the last block's units
    rows = _check_rows(gpt2, "transformer.h.")
    assert rows["pipeline"].stages == 2 and rows["pipeline"].split_points == ("transformer.h.12",)
    # The last stage holds its copy of the tied weight: both stages hold the embedding's 51.5 M.
    assert rows["pipeline"].memory.parameters > 51_463_168 * 4


def test_a_keras_hub_backbone_is_keras_and_cut_between_its_transformer_layers(backbone):
    assert backbone.framework == "keras"
    assert backbone.parameters == 4000 * 256 + 512 * 256 + 12 * 789_760 + 2 * 256
    assert [layer.name for layer in backbone.layers] == [f"transformer_layer_{j}" for j in range(12)]
    _check_rows(backbone, "transformer_layer_")


def test_cli_finds_the_framework_and_prints_block_split_points():
    command = [sys.executable, "-m", "dualframe", "plan", f"{MODELS}:gpt2_medium", "--input-shape", "512",
               "--input-dtype", "int64", "--batch-size", "8", "--optimizer", "adamw", "--memory-per-device", "16GB",
               "--devices-per-node", "4", "--nodes", "2", "--json"]
    result = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=300,
                            env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert result.returncode == 0, result.stderr[-2000:]
    plan = json.loads(result.stdout)
    model = plan["model"]
    assert model["framework"] == "torch" and sum(layer["parameters"] for layer in model["layers"]) == 354_823_168
    assert plan["recommended"]["kind"] == "data parallel + checkpointing"


def test_named_inputs_are_what_the_model_takes_by_default():
    small = f"{MODELS}:gpt2_small_measured"
    implied, named = measure([ModelSpec(small, (64,), "int64"),
                              ModelSpec(small, (64,), "int64", input_names=("input_ids", "attention_mask"))],
                             cwd=str(ROOT))[0]
    assert implied.to_dict() == named.to_dict()
    assert implied.input_elements == 2 * 64
    with pytest.raises(ProbeError, match="input names are distinct identifiers"):
        ModelSpec(small, (64,), "int64", input_names=("input_ids", "input_ids"))


def _peak(script: str, *args: str) -> int:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", MKL_NUM_THREADS="1",
               MALLOC_MMAP_THRESHOLD_="65536", TF_CPP_MIN_LOG_LEVEL="3")
    result = subprocess.run([sys.executable, str(ROOT / "tests/core/plan/plan_models" / script), *args],
                            capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])["peak"]


def _check_ratio(what: str, estimate: float, measured: int) -> None:
    assert measured > 64 * 2**20, f"{what}: the step used only {measured / 2**20:.1f} MiB, too little to compare"
    ratio = estimate / measured
    assert abs(ratio - 1) <= TOLERANCE, (
        f"{what}: estimated {estimate / 2**20:.1f} MiB, measured {measured / 2**20:.1f} MiB (ratio {ratio:.2f})")


@pytest.mark.parametrize("checkpointed", [False, True], ids=["plain", "checkpointed"])
def test_transformers_decoder_estimate_is_within_tolerance_of_measured_peak(checkpointed):
    source = "tests.core.plan.plan_models.hf_models:gpt2_small_measured"
    (profile,), _ = measure([ModelSpec(source, (128,), "int64", input_names=LABELS)], cwd=str(ROOT))
    training, whole = Training(8, "adam"), range(profile.num_layers)
    blocks = [layer.name for layer in profile.layers[:-1]] if checkpointed else []
    estimate = group_memory(profile, whole, training, checkpoint="segments" if checkpointed else "never",
                            cuts=list(whole) if checkpointed else ()).total
    measured = _peak("measure_torch.py", source, "8", "adam", "128", "int64", ",".join(blocks), ",".join(LABELS))
    _check_ratio(f"GPT2LMHeadModel{' checkpointed' if checkpointed else ''}", estimate, measured)


def test_keras_hub_backbone_estimate_is_within_tolerance_of_measured_peak():
    source = "tests.core.plan.plan_models.hf_models:gpt2_backbone_small"
    (profile,), _ = measure([ModelSpec(source, (128,), "int32")], cwd=str(ROOT))
    estimate = group_memory(profile, range(profile.num_layers), Training(32, "adam")).total
    _check_ratio("GPT2Backbone", estimate, _peak("measure_keras.py", source, "32", "128", "gpt2_backbone_tiny"))
