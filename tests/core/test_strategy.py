"""Strategy objects validate their arguments and plan rank grids."""
import pytest

import dualframe
from dualframe import BalanceError, ChunksError, DeviceError, ScheduleError, StrategyError


def test_data_parallel_defaults_and_normalisation():
    strategy = dualframe.DataParallel(op="Sum", compression="FP16")
    assert (strategy.op, strategy.compression, strategy.backward_passes_per_step) == ("sum", "fp16", 1)


@pytest.mark.parametrize("shard, expected", [(None, "none"), ("None", "none"), ("Optimizer", "optimizer"),
                                             ("gradients", "gradients")])
def test_data_parallel_shard_normalised(shard, expected):
    assert dualframe.DataParallel(shard=shard, op="sum").shard == expected


@pytest.mark.parametrize("kwargs, error, message", [
    ({"backward_passes_per_step": 0}, StrategyError, r"backward_passes_per_step must be an int >= 1 \(backward_passes_per_step: 0\)"),
    ({"op": "median"}, StrategyError, r"unknown op 'median'; choose one of average, sum"),
    ({"compression": "int8"}, StrategyError, r"unknown compression 'int8'; choose one of none, fp16"),
    ({"gradient_predivide_factor": 0}, StrategyError, r"gradient_predivide_factor must be a number > 0"),
    ({"op": "sum", "gradient_predivide_factor": 2.0}, StrategyError, r"only applies to op='average'"),
    ({"shard": "weights"}, StrategyError, r"unknown shard 'weights'; use None, 'optimizer' \(ZeRO-1\), 'gradients' \(ZeRO-2\) or 'parameters'"),
    ({"shard": 2}, StrategyError, r"unknown shard 2"),
    ({"shard": "optimizer", "op": "adasum"}, StrategyError, r"needs op Average or Sum \(op: adasum\)"),
])
def test_data_parallel_refuses_bad_input(kwargs, error, message):
    with pytest.raises(error, match=message):
        dualframe.DataParallel(**kwargs)


def test_model_parallel_and_pipeline():
    split = dualframe.ModelParallel([1, 2], ["cpu", "cpu"])
    assert split.balance == (1, 2) and split.devices == ("cpu", "cpu") and split.stages == 2
    pipe = dualframe.Pipeline([2, 2], chunks=4, checkpoint="Never", schedule="1F1B")
    assert (pipe.chunks, pipe.checkpoint, pipe.schedule, pipe.devices) == (4, "never", "1f1b", None)


@pytest.mark.parametrize("make, error, message", [
    (lambda: dualframe.ModelParallel([2, 0]), BalanceError, r"balance\[1\] = 0"),
    (lambda: dualframe.ModelParallel([2, 2], ["cpu"]), DeviceError, r"len\(devices\) = 1, len\(balance\) = 2"),
    (lambda: dualframe.ModelParallel([2, 2], ["cpu", ""]), DeviceError, r"devices\[1\]"),
    (lambda: dualframe.Pipeline([2, 2], chunks=0), ChunksError, r"chunks: 0"),
    (lambda: dualframe.Pipeline([2, 2], checkpoint="sometimes"), StrategyError, r"unknown checkpoint 'sometimes'"),
    (lambda: dualframe.Pipeline([2, 2], schedule="zigzag"), ScheduleError, r"unknown schedule 'zigzag'; choose one of gpipe, 1f1b"),
    (lambda: dualframe.Hybrid("pipeline"), StrategyError, r"Hybrid needs a dualframe.Pipeline"),
])
def test_split_strategies_refuse_bad_input(make, error, message):
    with pytest.raises(error, match=message):
        make()


def test_hybrid_grid_of_processes():
    hybrid = dualframe.Hybrid(dualframe.Pipeline([2, 2], chunks=4), stages_as_processes=True)
    grid = hybrid.grid(4)
    assert (grid.replicas, grid.stages) == (2, 2)
    assert grid.stage_groups == [[0, 2], [1, 3]]
    assert grid.pipeline_groups == [[0, 1], [2, 3]]
    assert [grid.position(r) for r in range(4)] == [(0, 0), (0, 1), (1, 0), (1, 1)]


def test_hybrid_in_process_split_makes_every_rank_a_replica():
    assert dualframe.Hybrid(dualframe.ModelParallel([1, 1])).grid(3).stage_groups == [[0, 1, 2]]


def test_hybrid_world_not_a_multiple_of_stages():
    hybrid = dualframe.Hybrid(dualframe.Pipeline([1, 1, 1]), stages_as_processes=True)
    with pytest.raises(StrategyError, match=r"multiple of the number of stages \(processes: 4, stages: 3\)"):
        hybrid.grid(4)
