"""dualframe.dp.settings: the one place the predivide factor becomes Horovod's prescale and postscale."""
from dualframe.dp.settings import ReduceSettings


def test_average_splits_the_division_around_the_sum():
    assert ReduceSettings(None, "average", gradient_predivide_factor=8.0).scale_factors() == (0.125, 8.0)
    assert ReduceSettings(None, "average").scale_factors() == (1.0, 1.0)


def test_other_ops_are_not_scaled():
    for op in ("sum", "adasum", "min", "max", "product"):
        assert ReduceSettings(None, op, gradient_predivide_factor=4.0).scale_factors() == (1.0, 1.0)


def test_with_passes_changes_only_the_passes():
    settings = ReduceSettings("fp16", "sum", sparse_as_dense=True, gradient_predivide_factor=2.0, process_set="ps")
    again = settings.with_passes(4)
    assert again.backward_passes_per_step == 4 and settings.backward_passes_per_step == 1
    assert (again.compression, again.op, again.sparse_as_dense, again.gradient_predivide_factor, again.process_set) == \
        ("fp16", "sum", True, 2.0, "ps")
