"""Random arguments to the core's plans: a valid plan, or a clear ValueError/TypeError — never another exception.

Hypothesis drives strategies, partitions, micro-batching, schedules, rank grids, topology and the
checkpoint folder with arbitrary values (wrong types, zero, negatives, huge negatives, strings). Positive
sizes stay small: a valid plan for 10**18 micro-batches is valid but would not fit in memory.
"""
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import dualframe
from dualframe.pipeline import clock, link_order, schedule
from dualframe.reliability.failure import Watchdog, stall_timeout
from dualframe.launch.topology import detect

SMALL = st.integers(min_value=-3, max_value=12)
ANY = st.one_of(SMALL, st.integers(max_value=0), st.floats(allow_nan=True), st.text(max_size=4), st.booleans(), st.none(),
                st.lists(SMALL, max_size=4))
COUNTS = st.one_of(st.lists(SMALL, max_size=6), ANY)
FAST = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def planned(call, *args, **kwargs):
    """Run ``call``; a ValueError or TypeError must carry a message, any other exception fails the test."""
    try:
        return call(*args, **kwargs)
    except (ValueError, TypeError) as error:
        assert str(error), f"{call.__name__}{args} raised {type(error).__name__} without a message"
        return None


@FAST
@given(balance=COUNTS, layers=st.one_of(st.none(), SMALL))
def test_partitions(balance, layers):
    ranges = planned(dualframe.partition_ranges, balance, layers)
    if ranges is not None:
        assert [len(r) for r in ranges] == list(balance)
        assert ranges[0].start == 0 and all(a.stop == b.start for a, b in zip(ranges, ranges[1:]))


@FAST
@given(costs=st.lists(st.one_of(st.floats(min_value=-1, max_value=1e6), st.floats()), max_size=8), partitions=ANY)
def test_balance_by_cost(costs, partitions):
    balance = planned(dualframe.balance_by_cost, costs, partitions)
    if balance is not None:
        assert sum(balance) == len(costs) and len(balance) == partitions and min(balance) >= 1


@FAST
@given(batch=ANY, chunks=ANY)
def test_micro_batches(batch, chunks):
    sizes = planned(dualframe.micro_batch_sizes, batch, chunks)
    if sizes is not None:
        assert sum(sizes) == batch and len(sizes) == chunks and max(sizes) - min(sizes) <= 1


@FAST
@given(passes=ANY, op=st.one_of(st.sampled_from(["average", "SUM", "adasum", "median"]), ANY),
       compression=st.one_of(st.sampled_from(["none", "fp16", "int8"]), ANY),
       factor=st.one_of(st.floats(allow_nan=True), ANY))
def test_data_parallel(passes, op, compression, factor):
    strategy = planned(dualframe.DataParallel, passes, op, compression, factor)
    if strategy is not None:
        assert strategy.backward_passes_per_step >= 1 and strategy.gradient_predivide_factor > 0


@FAST
@given(balance=COUNTS, chunks=ANY, checkpoint=st.one_of(st.sampled_from(["always", "never", "x"]), ANY),
       sched=st.one_of(st.sampled_from(["gpipe", "1F1B", "zb"]), ANY),
       devices=st.one_of(st.none(), st.lists(st.sampled_from(["cpu", "cuda:0", "", 3]), max_size=4), ANY),
       world=ANY, as_processes=st.booleans())
def test_pipeline_and_hybrid(balance, chunks, checkpoint, sched, devices, world, as_processes):
    pipeline = planned(dualframe.Pipeline, balance, devices, chunks, checkpoint, sched)
    if pipeline is None:
        return
    hybrid = planned(dualframe.Hybrid, pipeline, stages_as_processes=as_processes)
    grid = planned(hybrid.grid, world)
    if grid is not None:
        assert grid.replicas * grid.stages == world
        assert sorted(r for group in grid.stage_groups for r in group) == list(range(world))


@FAST
@given(name=st.one_of(st.sampled_from(["gpipe", "1f1b", "zb-h1", "GPipe", "other"]), ANY), stages=ANY, chunks=ANY)
def test_rank_schedules(name, stages, chunks):
    lists = planned(schedule.rank_schedule, name, stages, chunks)
    if lists is not None:
        assert len(lists) == stages
        table = clock.clock_table(lists)
        assert 0 <= clock.table_bubble(table) < 1
        link_order.check_link_order(lists)


@FAST
@given(name=st.one_of(st.sampled_from(["gpipe", "1f1b", "GPipe", "other"]), ANY), stages=ANY, chunks=ANY)
def test_clock_tick_schedules(name, stages, chunks):
    forward = planned(schedule.one_process_ticks, name, chunks, stages, "F")
    if forward is not None:
        assert name.lower() == "gpipe"  # the only registered schedule one process can run
        cells = [cell for tick in forward for cell in tick]
        assert len(cells) == len(set(cells)) == chunks * stages
        assert len(forward) == chunks + stages - 1
        assert len(planned(schedule.one_process_ticks, name, chunks, stages, "B")) == len(forward)


@FAST
@given(env=st.dictionaries(st.sampled_from(["HOROVOD_RANK", "HOROVOD_SIZE", "OMPI_COMM_WORLD_RANK",
                                            "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "PMI_RANK",
                                            "PMI_SIZE", "SLURM_PROCID", "SLURM_STEP_ID", "SLURM_TASKS_PER_NODE",
                                            "SLURM_NODEID", "SLURM_NTASKS"]),
                           st.one_of(st.integers(-2, 5).map(str), st.text(max_size=5)), max_size=6))
def test_topology(env):
    topo = planned(detect, env)
    if topo is not None:
        assert 0 <= topo.rank < topo.size and 0 <= topo.local_rank < topo.local_size


@FAST
@given(timeout=st.one_of(st.floats(allow_nan=True), ANY), variable=st.text(max_size=6))
def test_failure_settings(timeout, variable):
    watchdog = planned(Watchdog, timeout)
    if watchdog is not None:
        assert watchdog.timeout >= 0 and not math.isnan(watchdog.timeout)
    value = planned(stall_timeout, {"DUALFRAME_STALL_TIMEOUT": variable})
    if value is not None:
        assert value >= 0


@pytest.mark.parametrize("keep", [0, -1, 1.5, "3", None, True])
def test_checkpoint_folder_refuses_bad_keep(tmp_path, keep):
    from dualframe.reliability.checkpoint import CheckpointDir, CheckpointError
    with pytest.raises(CheckpointError, match="keep must be an int >= 1"):
        CheckpointDir(str(tmp_path), keep=keep)
