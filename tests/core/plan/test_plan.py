"""The advisor's arithmetic and rules on literal profiles (no framework, no subprocess but one)."""
import json
import pathlib
import subprocess
import sys

import pytest

import dualframe
from dualframe import StrategyError
from dualframe.plan import (Hardware, LayerProfile, Memory, ModelProfile, ModelSpec, ProbeError, Training,
                            advise, bubble, format_bytes, group_memory, parse_bytes, pipeline_chunks, render,
                            to_json)
from dualframe.pipeline.partition import partition_ranges
from dualframe.plan.advisor import options, step_cost
from dualframe.plan.cli import run as plan_run
from dualframe.plan.memory import FUSION_BUFFER_BYTES

ROOT = pathlib.Path(__file__).resolve().parents[3]
MiB = 2**20


def two_layers() -> ModelProfile:
    return ModelProfile("torch", "literal", (8,), [
        LayerProfile("a", parameters=1000, frozen=10, activations=10.0, output=5.0, largest=6.0),
        LayerProfile("b", parameters=3000, activations=20.0, output=2.0, largest=8.0),
    ], input_elements=8.0)


def chain(layers: int = 8, parameters: int = 10**6, activations: float = 10**4, output: float = 10**3) -> ModelProfile:
    """Equal layers: 4 MB of float32 weights each, ``activations`` elements per sample."""
    return ModelProfile("torch", "chain", (output,), [
        LayerProfile(f"l{j}", parameters, 0, activations, output, output) for j in range(layers)
    ], input_elements=output)


def test_memory_of_plain_training_by_hand():
    memory = group_memory(two_layers(), range(0, 2), Training(batch_size=4, optimizer="adam"))
    assert memory.parameters == (4000 + 10) * 4
    assert memory.gradients == 4000 * 4
    assert memory.optimizer == 4000 * 4 * 2
    assert memory.activations == (10 + 20) * 4 * 4
    assert memory.buffers == 2 * 8 * 4 * 4          # gradients of the largest tensor and its input
    assert memory.total == 16040 + 16000 + 32000 + 480 + 256


@pytest.mark.parametrize("optimizer, slots", [("sgd", 0), ("momentum", 1), ("adam", 2)])
def test_optimizer_state_per_optimizer(optimizer, slots):
    memory = group_memory(two_layers(), range(0, 2), Training(4, optimizer))
    assert memory.optimizer == slots * memory.gradients


def test_checkpointing_keeps_boundaries_and_one_recompute():
    profile, training = two_layers(), Training(batch_size=8, optimizer="sgd")
    per_layer = group_memory(profile, range(0, 2), training, checkpoint="layers")
    assert per_layer.activations == ((8 + 5) * 8 + 20 * 8) * 4      # inputs of both layers + largest layer
    gpipe = group_memory(profile, range(1, 2), training, chunks=4, checkpoint="except_last")
    assert gpipe.activations == (5 * 8 + 20 * 2) * 4               # stage input for 8 rows + one 2-row micro-batch
    assert gpipe.buffers == 2 * 8 * 2 * 4


def test_mixed_precision_halves_activations_and_adds_half_weights():
    full = group_memory(two_layers(), range(0, 2), Training(4))
    mixed = group_memory(two_layers(), range(0, 2), Training(4, mixed_precision=True))
    assert mixed.activations == full.activations / 2
    assert mixed.buffers == full.buffers / 2 + 4000 * 2
    assert mixed.parameters == full.parameters


def test_replicas_add_the_fusion_buffer():
    big = chain(layers=2, parameters=10**8)
    alone = group_memory(big, range(0, 2), Training(1, "sgd"))
    replicated = group_memory(big, range(0, 2), Training(1, "sgd"), replicas=4)
    assert replicated.buffers - alone.buffers == FUSION_BUFFER_BYTES


def test_bubble_and_chunks_rule():
    assert bubble(4, 16) == pytest.approx(3 / 19)
    assert bubble(1, 8) == 0
    assert pipeline_chunks(4, 64) == 16          # m = 4n
    assert pipeline_chunks(4, 6) == 6            # at most the batch


def test_validation_names_the_value():
    with pytest.raises(StrategyError, match=r"batch_size must be an int >= 1 \(batch_size: 0\)"):
        Training(0)
    with pytest.raises(StrategyError, match="unknown optimizer 'lamb'; choose one of sgd, momentum, adam"):
        Training(8, "lamb")
    with pytest.raises(StrategyError, match=r"devices_per_node must be an int >= 1 \(devices_per_node: 0\)"):
        Hardware(2**30, devices_per_node=0)
    with pytest.raises(StrategyError, match="headroom must be in"):
        Hardware(2**30, headroom=1.0)
    with pytest.raises(StrategyError, match="cannot read a memory size from '16 parsecs'"):
        parse_bytes("16 parsecs")
    with pytest.raises(StrategyError, match="has no layers"):
        ModelProfile("torch", "empty", (1,), [])
    with pytest.raises(StrategyError, match=r"layer 'x': parameters must be a number >= 0 \(parameters: -1\)"):
        LayerProfile("x", -1)


def test_model_spec_validation():
    with pytest.raises(ProbeError, match="a model is 'module:function'"):
        ModelSpec("models", (3,))
    with pytest.raises(ProbeError, match=r"input shape must be one or more ints >= 1.*\(input_shape: \(3, 0\)\)"):
        ModelSpec("models:cnn", (3, 0))
    with pytest.raises(ProbeError, match="unknown framework 'jax'"):
        ModelSpec("models:cnn", (3,), framework="jax")


def test_sizes_read_and_written():
    assert parse_bytes("16GiB") == 16 * 2**30
    assert parse_bytes("80GB") == 80 * 10**9
    assert parse_bytes("512") == 512
    assert format_bytes(1.5 * 2**30) == "1.5 GiB"
    assert format_bytes(300) == "300 B"


def test_profile_round_trips_through_json():
    profile = two_layers()
    assert ModelProfile.from_dict(json.loads(json.dumps(profile.to_dict()))) == profile


# One chain, four machines: the advisor's four answers. State per layer: 4 MB weights, 4 MB gradients,
# 8 MB Adam = 16 MB; 8 layers = 128 MB; activations at batch 32: 8 x 10^4 x 32 x 4 B = 10.24 MB.
CHAIN_STATE = 8 * 16e6


def test_fits_gives_data_parallel_on_every_device():
    plan = advise(chain(), Training(32), Hardware(4 * 2**30, devices_per_node=4, nodes=2))
    assert plan.recommended.kind == "data parallel" and plan.recommended.replicas == 8
    assert "dualframe.DataParallel()" in render(plan) and "dualframe run -np 8 --hostfile hosts train.py" in render(plan)


def test_nearly_fits_gives_checkpointing_or_accumulation():
    model = chain(activations=10**5)                 # 1 GB of activations at batch 32 beside 128 MB of state
    plain = advise(model, Training(32), Hardware(4 * 2**30, devices_per_node=2)).recommended.memory.total
    plan = advise(model, Training(32), Hardware(memory_per_device=plain * 0.85 / 0.9, devices_per_node=2))
    assert plan.recommended.kind in ("data parallel + checkpointing", "data parallel + accumulation")
    assert plan.recommended.memory.total <= plan.hardware.usable_memory < plain


def test_does_not_fit_gives_the_fewest_pipeline_stages_that_fit():
    # 3 devices: keeping every micro-batch's activations needs 4 stages, recomputing them 3.
    hardware = Hardware(memory_per_device=CHAIN_STATE * 0.4 / 0.9, devices_per_node=3, kind="gpu")
    plan = advise(chain(), Training(32), hardware)
    option = plan.recommended
    assert option.kind == "pipeline + checkpointing" and option.stages == 3 and option.replicas == 1
    assert option.chunks == 12 and sum(option.balance) == 8 and len(option.balance) == 3
    rows = {o.kind: o for o in options(chain(), Training(32), hardware)}
    assert rows["model split"].stages == 3 and not rows["model split"].fits  # all activations stay: 4 groups
    assert rows["pipeline"].stages == 3 and not rows["pipeline"].fits
    strategy = eval(to_json(plan)["recommended"]["strategy"], {"dualframe": dualframe})
    assert strategy == dualframe.Pipeline(list(option.balance), ["cuda:0", "cuda:1", "cuda:2"], 12, "except_last")
    assert "bubble 14%" in render(plan)              # (3 - 1) / (12 + 3 - 1)
    assert "recomputing" in plan.reason


def test_a_pipeline_keeps_its_activations_where_one_more_stage_costs_less_than_recomputing():
    hardware = Hardware(memory_per_device=CHAIN_STATE * 0.4 / 0.9, devices_per_node=4, kind="gpu")
    plan = advise(chain(), Training(32), hardware)
    option, (other,) = plan.recommended, plan.alternatives
    assert (option.kind, option.stages, option.checkpoint) == ("pipeline", 4, "never")
    assert (other.kind, other.stages, other.checkpoint) == ("pipeline + checkpointing", 3, "except_last")
    # 4 stages idle 3/19 of a step; 3 stages idle 2/14 and recompute 11 of 12 forwards (a third of a step each).
    assert step_cost(option) == pytest.approx(1 / (1 - 3 / 19))
    assert step_cost(other) == pytest.approx((1 + 11 / 12 / 3) / (1 - 2 / 14))
    # The checkpointed stage keeps its input for every row and one micro-batch's activations, nothing more.
    stage = partition_ranges(list(other.balance), 8)[0]
    kept = group_memory(chain(), stage, Training(32), chunks=12, checkpoint="except_last")
    assert kept.activations == (10**3 * 32 + len(stage) * 10**4 * 3) * 4  # 32 rows in 12 micro-batches: 3 rows


def test_does_not_fit_with_devices_to_spare_gives_hybrid():
    hardware = Hardware(memory_per_device=CHAIN_STATE * 0.4 / 0.9, devices_per_node=4, nodes=3, kind="gpu")
    plan = advise(chain(), Training(32), hardware)
    option = plan.recommended
    # Replicas add Horovod's fusion buffer (the stage's 12 MB of gradients): 3 stages no longer fit, 4 do.
    assert option.kind == "hybrid" and option.stages == 4 and option.replicas == 3
    strategy = eval(to_json(plan)["recommended"]["strategy"], {"dualframe": dualframe})
    assert isinstance(strategy, dualframe.Hybrid) and strategy.stages_as_processes
    assert strategy.grid(option.devices).replicas == 3 and strategy.pipeline.chunks == 16
    assert to_json(plan)["recommended"]["launch"] == "dualframe run -np 12 --hostfile hosts train.py"


def test_nothing_fits_says_so_and_what_to_change():
    plan = advise(chain(), Training(32), Hardware(memory_per_device=10 * MiB, devices_per_node=2))
    assert plan.recommended is None
    assert "nothing fits" in plan.reason and "mixed precision" in plan.reason


def test_bad_cli_input_is_refused_before_any_probe(capsys):
    assert plan_run(["models", "--input-shape", "3"]) == 2
    assert "a model is 'module:function'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        plan_run(["models:cnn", "--input-shape", "3,-1"])


def test_the_plan_package_loads_no_framework():
    code = ("import sys, dualframe.plan, dualframe.plan.cli, dualframe.launch.run, dualframe.cli\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'tensorflow', 'keras', 'horovod')))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0 and result.stdout.strip() == "[]", result.stdout + result.stderr


def test_memory_total_adds_up():
    assert Memory(1, 2, 3, 4, 5).total == 15
