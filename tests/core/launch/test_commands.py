"""Launcher command lines and thread settings."""
import pytest

from dualframe import StrategyError
from dualframe.launch.commands import horovodrun_command, mpirun_command, srun_command, thread_env


def test_horovodrun_gloo_on_localhost():
    assert horovodrun_command(2, ["python", "t.py"]) == ["horovodrun", "-np", "2", "-H", "localhost:2", "--gloo", "python", "t.py"]


def test_horovodrun_hostfile_mpi_and_interfaces():
    command = horovodrun_command(4, ["python", "t.py"], hostfile="hosts", gloo=False, network_interfaces="lo")
    assert command == ["horovodrun", "-np", "4", "--hostfile", "hosts", "--mpi", "--network-interfaces", "lo", "python", "t.py"]


def test_mpirun_as_root_oversubscribed_with_exports():
    command = mpirun_command(2, ["python", "t.py"], export=("OMP_NUM_THREADS",), oversubscribe=True, as_root=True)
    assert command == ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", "2", "--bind-to", "none",
                       "--map-by", "slot", "-x", "OMP_NUM_THREADS", "python", "t.py"]


def test_srun():
    assert srun_command(8, ["python", "t.py"], cpus_per_task=4) == ["srun", "--ntasks=8", "--cpus-per-task=4", "python", "t.py"]


def test_thread_env_shares_cores():
    assert thread_env(2, cores=16)["OMP_NUM_THREADS"] == "8"
    assert thread_env(4, cores=2)["TF_NUM_INTRAOP_THREADS"] == "1"


def test_bad_np():
    with pytest.raises(StrategyError, match=r"-np must be an int >= 1 \(np: 0\)"):
        mpirun_command(0, ["python"])
