"""dualframe.launch.mpi_defaults: what it sets before MPI starts, and what it leaves alone."""
from dualframe.launch import mpi_defaults

YIELD = "OMPI_MCA_mpi_yield_when_idle"


def test_fills_in_yield_when_idle():
    env = {"OMPI_COMM_WORLD_SIZE": "2"}
    assert mpi_defaults.apply(env) == {YIELD: "1"}
    assert env[YIELD] == "1"


def test_a_value_the_user_set_wins():
    env = {YIELD: "0"}
    assert mpi_defaults.apply(env) == {}
    assert env[YIELD] == "0"


def test_switched_off_leaves_the_environment_alone():
    env = {mpi_defaults.SWITCH_VARIABLE: "0"}
    assert mpi_defaults.apply(env) == {}
    assert env == {mpi_defaults.SWITCH_VARIABLE: "0"}


def test_gloo_controller_cycles_every_5_ms_unless_the_job_says_otherwise():
    env = {"HOROVOD_CONTROLLER": "gloo"}
    assert mpi_defaults.apply(env) == {YIELD: "1", "HOROVOD_CYCLE_TIME": "5"}
    mine = {"HOROVOD_CONTROLLER": "gloo", "HOROVOD_CYCLE_TIME": "1"}
    assert mpi_defaults.apply(mine) == {YIELD: "1"} and mine["HOROVOD_CYCLE_TIME"] == "1"
    mpi = {"OMPI_COMM_WORLD_SIZE": "2"}
    mpi_defaults.apply(mpi)
    assert "HOROVOD_CYCLE_TIME" not in mpi  # MPI keeps Horovod's 1 ms
