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
