"""validate_split: every argument of a one-process model split checked before anything runs; default devices."""
import pytest

from dualframe.errors import BalanceError, ChunksError, DeviceError, ScheduleError, StrategyError
from dualframe.pipeline.split import default_devices, validate_split
from dualframe.launch.topology import Topology


def canonical(name):
    if name not in ("cpu", "gpu:0", "gpu:1", "gpu:7"):
        raise DeviceError(f"unknown device {name!r}")
    return name


def plan(balance, devices, chunks=1, checkpoint="never", layers=4, schedule="gpipe"):
    return validate_split(layers, balance, devices, chunks, checkpoint, available=["cpu", "gpu:0", "gpu:1"],
                          canonical=canonical, accelerators=["gpu:0", "gpu:1"], schedule=schedule)


def test_valid_plan():
    p = plan([1, 3], ["gpu:0", "gpu:1"], chunks=3, checkpoint="always")
    assert p.ranges == (range(0, 1), range(1, 4)) and p.devices == ("gpu:0", "gpu:1") and p.stages == 2
    assert p.balance == [1, 3] and [p.checkpointed(i) for i in range(3)] == [True] * 3
    assert [plan([4], ["cpu"], 3, "except_last").checkpointed(i) for i in range(3)] == [True, True, False]
    assert not plan([4], ["cpu"], 3, "never").checkpointed(0)
    assert p.schedule == "gpipe" and plan([4], ["cpu"], schedule="GPipe").schedule == "gpipe"


def test_schedules_one_process_cannot_run_are_refused_by_name_before_anything_runs():
    with pytest.raises(ScheduleError, match=r"the one-process Pipeline cannot run schedule '1f1b': 1f1b interleaves "
                                            r"backward with forward .* use schedule='gpipe' here, or "
                                            r"DistributedPipeline\(\.\.\., schedule='1f1b', loss_fn=\.\.\.\)"):
        plan([2, 2], ["cpu", "cpu"], chunks=4, schedule="1f1b")
    with pytest.raises(ScheduleError, match=r"unknown schedule 'zigzag'; choose one of gpipe, 1f1b"):
        plan([2, 2], ["cpu", "cpu"], schedule="zigzag")


@pytest.mark.parametrize("balance, devices, chunks, checkpoint, error, message", [
    ([2, 3], ["cpu", "cpu"], 1, "never", BalanceError, r"balance: \[2, 3\] = 2 \+ 3 = 5, layers: 4"),
    ([4, 0], ["cpu", "cpu"], 1, "never", BalanceError, r"balance\[1\] = 0"),
    ([5, -1], ["cpu", "cpu"], 1, "never", BalanceError, r"balance\[1\] = -1"),
    ([2, 2], ["cpu"], 1, "never", DeviceError, r"len\(devices\) = 1, len\(balance\) = 2"),
    ([2, 2], ["cpu", "tpu:0"], 1, "never", DeviceError, r"unknown device 'tpu:0'"),
    ([2, 2], ["cpu", "gpu:7"], 1, "never", DeviceError, r"'gpu:7' \(devices\[1\]\) is not available here; available: cpu, gpu:0, gpu:1"),
    ([2, 2], ["cpu", "cpu"], 0, "never", ChunksError, r"chunks must be an int >= 1 \(chunks: 0\)"),
    ([2, 2], ["cpu", "cpu"], 2, "sometimes", StrategyError, r"unknown checkpoint 'sometimes'"),
])
def test_bad_arguments_refused_with_values(balance, devices, chunks, checkpoint, error, message):
    with pytest.raises(error, match=message):
        plan(balance, devices, chunks, checkpoint)


def test_default_devices():
    gpus = ["g0", "g1", "g2", "g3"]
    assert default_devices(2, [], "cpu", Topology()) == ["cpu", "cpu"]
    assert default_devices(2, gpus, "cpu", Topology()) == ["g0", "g2"]
    assert default_devices(4, ["g0", "g1"], "cpu", Topology()) == ["g0", "g0", "g1", "g1"]
    assert default_devices(2, gpus, "cpu", Topology(0, 2, 0, 2)) == ["g0", "g1"]
    assert default_devices(2, gpus, "cpu", Topology(3, 4, 1, 2)) == ["g2", "g3"]
    # the launcher already restricted what this rank sees (e.g. CUDA_VISIBLE_DEVICES per rank)
    assert default_devices(2, ["g0"], "cpu", Topology(1, 2, 1, 2)) == ["g0", "g0"]


def test_default_devices_used_when_omitted(monkeypatch):
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "1")
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "2")
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_RANK", "1")
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "2")
    monkeypatch.delenv("HOROVOD_RANK", raising=False)
    assert plan([2, 2], None).devices == ("gpu:1", "gpu:1")
