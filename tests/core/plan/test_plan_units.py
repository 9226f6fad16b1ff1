"""Shared (tied) parameters counted once and copied where read; a probe's nodes merged into block units."""
import json

import pytest

from dualframe.errors import StrategyError
from dualframe.plan import LayerProfile, ModelProfile, Training, group_memory
from dualframe.plan.cuts import StageCosts, stage_starts
from dualframe.plan.profile import Shared, Value
from dualframe.plan.units import merge_units

BATCH = 4


def tied_lm() -> ModelProfile:
    """wte (1000, tied with the head), two blocks (100 each), ln_f, the head (reads wte's weight)."""
    layers = [LayerProfile("wte", 1000, 0, 1.0, 8.0, 8.0), LayerProfile("h.0", 100, 0, 50.0, 8.0, 8.0, "h.0"),
              LayerProfile("h.1", 100, 0, 50.0, 8.0, 8.0), LayerProfile("ln_f", 10, 0, 8.0, 8.0, 8.0),
              LayerProfile("head", 0, 0, 40.0, 40.0, 40.0)]
    values = [Value(-1, 0, 1.0), Value(-1, 2, 1.0), Value(0, 1, 8.0), Value(1, 2, 8.0), Value(2, 3, 8.0),
              Value(3, 4, 8.0)]
    return ModelProfile("torch", "lm", (1,), layers, 1.0, values=values, shared=[Shared(1000, (4, 0))])


def test_a_shared_parameter_counts_once_and_is_copied_to_other_readers():
    model = tied_lm()
    assert model.parameters == 1210 and model.shared[0].readers == (0, 4)
    assert model.copies(0, 5) == 0 and model.copies(0, 2) == 0 and model.copies(3, 5) == 1000
    training = Training(BATCH, "sgd")
    head = group_memory(model, range(3, 5), training)
    assert head.parameters == head.gradients == (10 + 1000) * 4
    costs = StageCosts(model, training)
    assert costs.parameters(3, 5) == 1010 and costs.total(3, 5) == head.total


def test_merging_into_blocks_keeps_totals_and_drops_what_stays_inside_a_unit():
    units = merge_units(tied_lm(), ["h.0", "h.0", "h.1", "h.1", "h.1"])
    assert [(layer.name, layer.parameters, layer.activations, layer.split_point) for layer in units.layers] == [
        ("h.0", 1100, 51.0, "wte"), ("h.1", 110, 98.0, "h.1")]
    assert units.layers[1].output == 40.0 and units.layers[1].largest == 40.0
    # The mask (input, read by h.1) and h.0's output cross the one cut; the rest stays inside a unit.
    assert sorted((v.producer, v.last_reader, v.elements) for v in units.values) == [(-1, 0, 1.0), (-1, 1, 1.0),
                                                                                      (0, 1, 8.0)]
    assert units.shared == (Shared(1000, (0, 1)),) and units.copies(1, 2) == 1000
    assert stage_starts(units, Training(BATCH, "sgd"), stages=2) == [0, 1]
    assert ModelProfile.from_dict(json.loads(json.dumps(units.to_dict()))) == units


def test_a_unit_in_two_places_and_bad_shared_parameters_are_refused():
    with pytest.raises(StrategyError, match="unit 'a' runs in two separate places"):
        merge_units(tied_lm(), ["a", "a", "b", "a", "a"])
    with pytest.raises(StrategyError, match=r"one unit per node \(units: 1, nodes: 5\)"):
        merge_units(tied_lm(), ["a"])
    with pytest.raises(StrategyError, match="two or more readers"):
        Shared(10, (3, 3))
    with pytest.raises(StrategyError, match="read by a node past the last of 5"):
        ModelProfile("torch", "lm", (1,), tied_lm().layers, 1.0, shared=[Shared(10, (0, 5))])
