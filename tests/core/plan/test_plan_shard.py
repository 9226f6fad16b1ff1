"""The plan's sharded data-parallel rows: ZeRO-1/2 arithmetic by hand, and where the advisor places them."""
import dataclasses

import pytest

from dualframe.dp.shard import BUCKET_ELEMENTS
from dualframe.errors import StrategyError
from dualframe.plan import Hardware, LayerProfile, ModelProfile, Training, advise, group_memory, render, to_json
from dualframe.plan.advisor import options
from dualframe.plan.profile import Shared
from dualframe.plan.memory import shard_divisors

MB = 1e6


def two_layers() -> ModelProfile:
    return ModelProfile("torch", "literal", (8,), [
        LayerProfile("a", parameters=1000, frozen=10, activations=10.0, output=5.0, largest=6.0),
        LayerProfile("b", parameters=3000, activations=20.0, output=2.0, largest=8.0),
    ], input_elements=8.0)


def chain() -> ModelProfile:
    """8 layers of 1 M parameters: 32 MB of weights, 32 MB of gradients, 64 MB of Adam state."""
    return ModelProfile("torch", "chain", (1000,), [
        LayerProfile(f"l{j}", 10**6, 0, 10**4, 1000, 1000) for j in range(8)], input_elements=1000)


@pytest.mark.parametrize("optimizer, slots", [("sgd", 0), ("momentum", 1), ("adam", 2), ("adamw", 2)])
@pytest.mark.parametrize("replicas", [2, 4])
def test_sharded_state_and_gradients_by_hand(optimizer, slots, replicas):
    profile, training = two_layers(), Training(batch_size=4, optimizer=optimizer)
    plain = group_memory(profile, range(2), training, replicas=replicas)
    zero1 = group_memory(profile, range(2), training, replicas=replicas, shard="optimizer")
    zero2 = group_memory(profile, range(2), training, replicas=replicas, shard="gradients")
    assert plain.optimizer == 4000 * 4 * slots and plain.gradients == 4000 * 4
    assert zero1.optimizer == zero2.optimizer == 4000 * 4 * slots / replicas
    assert zero1.gradients == 4000 * 4 * (1 + 1 / replicas)   # the full gradients and the reduced slice
    assert zero2.gradients == 4000 * 4 / replicas
    assert zero1.parameters == zero2.parameters == plain.parameters
    assert zero1.activations == plain.activations
    assert zero1.buffers == zero2.buffers == plain.buffers + 2 * min(4000, BUCKET_ELEMENTS) * 4


def test_shard_divisors_and_bad_mode():
    assert shard_divisors(None, 8) == (1.0, 1)
    assert shard_divisors("gradients", 8) == (8.0, 8)
    with pytest.raises(StrategyError, match="unknown shard 'weights'"):
        group_memory(two_layers(), range(2), Training(4), replicas=2, shard="weights")


def _plan(usable_mb, devices=8):
    return advise(chain(), Training(32), Hardware(memory_per_device=usable_mb * MB / 0.9, devices_per_node=devices))


def test_rows_after_plain_data_parallel_when_plain_fits():
    plan = _plan(1000)
    kinds = [o.kind for o in plan.options]
    assert plan.recommended.kind == "data parallel"
    assert kinds[:3] == ["data parallel", "data parallel + sharded optimizer", "data parallel + sharded gradients"]
    rows = {o.kind: o for o in plan.options}
    assert rows["data parallel + sharded gradients"].memory.total < rows["data parallel + sharded optimizer"].memory.total \
        < rows["data parallel"].memory.total
    text = render(plan)
    assert "data parallel + sharded optimizer" in text and "data parallel + sharded gradients" in text


def test_one_device_has_no_sharded_rows():
    kinds = [o.kind for o in options(chain(), Training(32), Hardware(10**12, devices_per_node=1))]
    assert not [k for k in kinds if "sharded" in k]


@pytest.mark.parametrize("usable_mb, kind, shard", [
    (160, "data parallel + sharded optimizer", "optimizer"),    # plain needs ~170 MB, ZeRO-1 ~150 MB
    (130, "data parallel + sharded gradients", "gradients"),    # ZeRO-2 ~118 MB
])
def test_sharding_is_recommended_before_checkpointing_and_pipelines(usable_mb, kind, shard):
    plan = _plan(usable_mb)
    rows = {o.kind: o for o in plan.options}
    assert not rows["data parallel"].fits and not rows["data parallel + checkpointing"].fits
    assert rows["pipeline"].fits                    # a pipeline would fit too: sharding comes first
    assert plan.recommended.kind == kind and plan.recommended.shard == shard, plan.reason
    assert "sharding the optimizer state" in plan.reason
    recommended = to_json(plan)["recommended"]
    assert recommended["adapter"].endswith(f"shard={shard!r})") and recommended["shard"] == shard
    assert recommended["strategy"] == f"dualframe.DataParallel(shard={shard!r})"


def test_sharded_parameters_when_sharded_gradients_and_checkpointing_do_not_fit():
    plan = _plan(100)                               # ZeRO-2 ~120 MB, checkpointing ~162 MB, ZeRO-3 ~71 MB
    rows = {o.kind: o for o in plan.options}
    assert not rows["data parallel + sharded gradients"].fits and not rows["data parallel + checkpointing"].fits
    assert rows["pipeline"].fits
    assert plan.recommended.kind == "data parallel + sharded parameters", plan.reason
    assert "sharding the parameters, gradients and optimizer state" in plan.reason
    recommended = to_json(plan)["recommended"]
    assert recommended["adapter"].endswith("shard='parameters', model=model)")
    assert recommended["strategy"] == "dualframe.DataParallel(shard='parameters')"


def test_keras_gets_the_sharded_parameters_row_too():
    keras_chain = dataclasses.replace(chain(), framework="keras")
    plan = advise(keras_chain, Training(32), Hardware(memory_per_device=100 * MB / 0.9, devices_per_node=8))
    assert plan.recommended.kind == "data parallel + sharded parameters", plan.reason
    recommended = to_json(plan)["recommended"]
    assert recommended["adapter"] == ("optimizer = hvd.DistributedOptimizer(optimizer, shard='parameters'); "
                                      "model = optimizer.shard_model(model)")
    assert recommended["strategy"] == "dualframe.DataParallel(shard='parameters')"


def test_sharded_parameters_by_hand():
    profile, training = two_layers(), Training(batch_size=4, optimizer="adam")
    plain = group_memory(profile, range(2), training, replicas=4)
    zero3 = group_memory(profile, range(2), training, replicas=4, shard="parameters")
    assert zero3.parameters == 4000 * 4 / 4 + 10 * 4     # the frozen parameters stay whole
    assert zero3.gradients == 4000 * 4 / 4 and zero3.optimizer == 4000 * 4 * 2 / 4
    assert zero3.buffers == plain.buffers + 3 * 3000 * 4  # three copies of the largest layer
    assert zero3.activations == plain.activations


def test_a_pipeline_when_even_sharded_parameters_do_not_fit():
    plan = _plan(60)
    rows = {o.kind: o for o in plan.options}
    assert not rows["data parallel + sharded parameters"].fits
    assert plan.recommended.kind in ("pipeline", "hybrid")


@pytest.mark.parametrize("framework", ["torch", "keras"])
def test_no_sharded_parameters_row_for_tied_weights(framework):
    shared = (Shared(1000, (0, 7)),)  # each block frees its own weights: a tied pair is refused in both adapters
    profile = ModelProfile(framework, "chain", (1000,), chain().layers, input_elements=1000, shared=shared)
    kinds = [o.kind for o in options(profile, Training(32), Hardware(10**12, devices_per_node=4))]
    assert "data parallel + sharded gradients" in kinds and "data parallel + sharded parameters" not in kinds
