"""Units of a model built around repeated blocks: each block a unit, what runs outside joins the block before."""
import pytest

from dualframe.pipeline.units import block_units


def test_nodes_outside_the_blocks_join_the_block_before_them():
    names = ["wte", "wpe", "h.0", "h.1", "h.2", "ln_f", "lm_head"]
    blocks = [False, False, True, True, True, False, False]
    assert block_units(names, blocks) == ["h.0", "h.0", "h.0", "h.1", "h.2", "h.2", "h.2"]


def test_without_blocks_every_node_is_its_own_unit():
    assert block_units(["conv", "fc"], [False, False]) == ["conv", "fc"]


def test_one_flag_per_node():
    with pytest.raises(ValueError, match=r"one block flag per node \(names: 2, blocks: 1\)"):
        block_units(["a", "b"], [True])
